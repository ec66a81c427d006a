"""When to act: real optimizer steps counted in rounds, and every ``N``-th of them.

The one counter of the integrations: the step core (:class:`~gaugeopt.integrations.steps.StepCounter`,
under the Lightning and Hugging Face callbacks and :class:`~gaugeopt.integrations.clip.ClipSteps`)
and :class:`gaugeopt.GaugeOptimizer`'s ``fix_every`` count with a :class:`Schedule`.

A *round* is one step of every optimizer that owns the watched parameters: with one optimizer each
step is a round; with several (``backward(); muon.step(); adamw.step()``) the round is complete when
each has stepped since the last complete round — an owner whose step a ``GradScaler`` skipped keeps it
open until its next real step. The action comes after rounds ``every, 2·every, ...`` (1-based).

Example:
    >>> from gaugeopt.integrations.schedule import Schedule
    >>> s = Schedule(every=2, members=2)               # two optimizers step each iteration
    >>> [s.stepped(who) for who in ("muon", "adamw", "muon", "muon", "adamw")]
    [False, True, False, False, True]
    >>> s.steps, s.due(), s.due(3)
    (2, True, False)
"""

from __future__ import annotations

from typing import Any, Hashable

from gaugeopt.errors import GaugeError

__all__ = ["check_every", "Schedule"]


def check_every(every: Any, name: str = "every", *, optional: bool = False, who: str = "") -> int | None:
    """``every`` as a positive number of optimizer steps (``None`` too when ``optional``), or
    :class:`GaugeError` naming it (after ``who:`` when given)."""
    if optional and every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        what = "a positive integer number of optimizer steps" + (" or None" if optional else "")
        raise GaugeError(f"{who + ': ' if who else ''}{name}={every!r} must be {what}")
    return every


class Schedule:
    """Count rounds of real optimizer steps; say after which to act.

    Args:
        every: act after rounds ``every, 2·every, ...`` (``None`` with ``optional``: never).
        members: the optimizers that step in one round (:meth:`expect` changes it).
        name, optional, who: how ``every`` is named and checked (:func:`check_every`).

    Attributes:
        steps: completed rounds (a host puts it in its checkpoints).
    """

    def __init__(self, every: int | None, members: int = 1, *, name: str = "every", optional: bool = False,
                 who: str = "") -> None:
        self.every = check_every(every, name, optional=optional, who=who)
        self.steps = 0
        self._members = members
        self._stepped: list[Hashable] = []  # who stepped in the open round

    def expect(self, members: int) -> None:
        """``members`` optimizers step per round from now on; the open round starts again."""
        self._members, self._stepped = members, []

    @property
    def opening(self) -> bool:
        """Whether the next step opens a round (no member stepped since the last complete round)."""
        return not self._stepped

    def stepped(self, who: Hashable = None) -> bool:
        """Record that ``who`` stepped; ``True`` when that completes a round (:attr:`steps` counts it)."""
        if who not in self._stepped:
            self._stepped.append(who)
        if len(self._stepped) < self._members:
            return False
        self._stepped = []
        self.steps += 1
        return True

    def due(self, step: int | None = None) -> bool:
        """Whether to act after round ``step`` (default: the last completed one)."""
        step = self.steps if step is None else step
        return self.every is not None and step % self.every == 0
