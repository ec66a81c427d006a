"""The registry of attention sectors: one :class:`Sector` description per gauge symmetry, registered once.

A *sector* is one family of gauge symmetries of an attention record (docs/gauge_group.md): ``qk``
(``GL(d_k)`` per KV group in the RoPE commutant), ``vo``, ``perm``, the multiplier sectors, the QK-norm
gain gauge, the bias sectors, the sectors of multi-head latent attention. Its :class:`Sector` says
everything the rest of gaugeopt needs to know about it, and every list of sectors is derived from the
registry in registration order:

====================  ==========================================================================
field                 used by
====================  ==========================================================================
``lacking``           whether the sector is a symmetry of a record's kind of attention, and if not
                      why (:func:`gaugeopt.random_gauge_transform` refuses it when asked by name)
``present``           whether the record holds it non-trivially: the certificate claims the sectors
                      that are neither lacking nor absent (:func:`claimed`)
``valid``             a finite random element (:func:`gaugeopt.random_gauge_transform`,
                      :func:`~gaugeopt.transforms.apply_valid`, the certificate)
``control``           the certificate's negative control, which must change the output ``≥ 1e-3``
``through_scores``    it changes queries, keys, scores or values through the softmax: a module that
                      computes a step in float32 is certified to ``1e-6`` there, not ``1e-10``
``families``          its continuous families (:mod:`gaugeopt.flat.symmetries`, the flat-direction meter)
``projection``        how :class:`gaugeopt.GaugeProjector` builds it (:class:`ProjectionRule`), opt-in or not
``count``             its dimension per layer in ``gauge_dimension(..., "complete")``
====================  ==========================================================================

Named negative controls (:func:`gaugeopt.invalid_gauge_transform`) are registered beside the sectors as
:class:`Control` entries. The built-in sectors are registered by one module per family
(:mod:`.heads`, :mod:`.multipliers`, :mod:`.norm_gains`, :mod:`.biases`, :mod:`.latents`); a new
sector is one more module that calls :func:`register` (docs/sectors.md has the checklist).

Example:
    >>> from gaugeopt import sectors
    >>> [s.name for s in sectors.sectors() if s.family == "head"]
    ['qk', 'vo', 'perm']
    >>> sectors.sector("value_bias").projection.opt_in
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

import torch

from gaugeopt.errors import GaugeError

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

    from gaugeopt.records.site import AttentionSite

__all__ = [
    "CONTROL_GROUPS", "Control", "Family", "ProjectionRule", "Sector", "claimed", "control", "controls", "generation",
    "in_proof_order", "in_transform_order", "register",
    "register_control", "run", "sector", "sectors", "unregister", "unregister_control",
]

# The groups of named controls, in the order :data:`gaugeopt.transforms.INVALID_KINDS` lists them
# ("latent" ones are listed apart, in LATENT_INVALID_KINDS).
CONTROL_GROUPS = ("plain", "qk_norm", "bias", "sinks", "latent")


@dataclass(frozen=True)
class Family:
    """A continuous family of transformations of one model's parameters.

    Attributes:
        name: the sector (a :class:`Sector`'s name, a stream sector of
            :mod:`gaugeopt.flat.stream_sectors`, or a near-symmetry such as ``key_bias_rope``).
        unit: where it acts (an attention site, a norm, a layer, ``"model"``).
        dim: the length of ``t``.
        apply: ``apply(t)`` moves the model the family was built on, in place, by ``g(t)``; ``t`` is
            real or complex (complex steps give exact generators); ``t = 0`` is the identity.
        exact: whether ``g(t)`` is a symmetry of the model as built (``False``: a family listed to
            show that it is *not* one, e.g. residual rotations under a tied head).
        why: one line on why it is (or is not) a symmetry.
    """

    name: str
    unit: str
    dim: int
    apply: Callable[[torch.Tensor], None]
    exact: bool = True
    why: str = ""


@dataclass(frozen=True)
class ProjectionRule:
    """How :class:`gaugeopt.GaugeProjector` builds a sector.

    Attributes:
        solver: ``"dense"`` (Sylvester or closed form per RoPE plane), ``"diagonal"``, ``"internal"``
            (the LRM layers' rescalings) or ``"bias_shift"`` — the solvers of :mod:`gaugeopt.projection` —,
            or a factory ``solver(name, units, options) -> solver object`` for a sector whose module
            brings its own (the protocol of :mod:`gaugeopt.projection.context`).
        moves: the record's tensors the sector moves, as roles (``"q.weight"``, ``"o.col_mult"``,
            ``"qk_norm.q_gain"``, ``"latent.k_rope"``, ...; a sector's own tensors under its own
            names). Two sectors that move a common role share parameter entries and are projected
            jointly (:mod:`gaugeopt.projection.joint`); the others' spans are orthogonal.
        units: ``"sites"`` (attention records) or ``"lrm_layers"`` (every LRM layer the records read).
        sites: which records the solver gets (default: every one; the solver skips those without the sector).
        opt_in: ``"auto"`` leaves it out, ``"all"`` includes it (a cost the projector does not pay by default).
        redundant_with: beside ``lrm_internal`` its span lies in this sector's plus ``lrm_internal``'s:
            the joint projection leaves it out when both are there.
        last: it overlaps every other family: the joint projection eliminates it exactly, last.
    """

    solver: Union[str, Callable[..., Any]]
    moves: frozenset[str]
    units: str = "sites"
    sites: Callable[["AttentionSite"], bool] | None = None
    opt_in: bool = False
    redundant_with: str | None = None
    last: bool = False


@dataclass(frozen=True)
class Control:
    """A named negative control (:func:`gaugeopt.invalid_gauge_transform`): a transformation that
    looks like a gauge and must change the function.

    Attributes:
        name: its ``kind``.
        group: one of :data:`CONTROL_GROUPS` (the public tuples of :mod:`gaugeopt.transforms`).
        needs: ``needs(site)``: the control applies to this record.
        needs_what: what a model must have for it (the error when no record has it).
        apply: ``apply(site, generator, log_scale)``, in place.
    """

    name: str
    group: str
    needs: Callable[["AttentionSite"], bool]
    needs_what: str
    apply: Callable[["AttentionSite", torch.Generator | None, float], None]


def _always(site: "AttentionSite") -> bool:
    return True


@dataclass(frozen=True, eq=False)
class Sector:
    """One sector of the attention gauge group (the module docstring says who reads which field).

    Attributes:
        name: the sector's name (``kinds=``, ``sectors=``, report keys).
        family: ``"head"``, ``"multiplier"``, ``"norm_gain"``, ``"bias"``, ``"latent"`` or a new one.
        summary: the action in one line.
        lacking: ``lacking(site)``: ``None`` when the sector is a symmetry of this kind of attention,
            else why not (a QK-norm record has no ``qk``).
        valid: ``valid(site, generator, log_scale)``: apply a random valid element, in place.
        control: ``control(site, generator)``: apply the negative control, in place; returns its name.
        present: ``present(site)``: the record holds the sector non-trivially (``perm`` needs two heads
            in an order that may change, ``lrm_vo`` multipliers); the certificate claims a sector that
            is neither lacking nor absent.
        proof_element: the element the certificate applies, where ``valid`` may draw the identity
            (``perm``); default ``valid(site, generator, 0.5)``.
        through_scores: certified to ``1e-6`` instead of ``1e-10`` on a module that computes a step in
            float32 (``site.float32_steps``).
        families: ``families(site)``: its continuous families on a record that has it.
        near_families: ``near_families(site)``: transformations mistaken for it that are *not*
            symmetries of this record (``exact=False``: the key-bias shift on RoPE-rotated channels),
            listed by the flat-direction meter to show how far from flat they are.
        layer_valid, layer_families: for a sector whose units are layers, not attention records
            (``lrm_internal``): the random element on every such layer of a model, and their families.
        projection: :class:`ProjectionRule`, or ``None`` for a sector the projector does not remove.
        count: ``count(shape) -> {name: dimension}`` for one layer (a
            :class:`~gaugeopt.flat.counting.LayerShape`), in ``convention="complete"``.
        default: :func:`gaugeopt.random_gauge_transform` draws it without ``kinds=``.
        proof_order, transform_order: where the certificate (and the families) and
            :func:`gaugeopt.random_gauge_transform` take it (lower first, then registration order):
            the orders the built-in sectors always had, so that a seed gives the same elements. A new
            sector keeps the defaults (last).
    """

    name: str
    family: str
    summary: str
    lacking: Callable[["AttentionSite"], str | None]
    valid: Callable[["AttentionSite", torch.Generator | None, float], None]
    control: Callable[["AttentionSite", torch.Generator], str]
    present: Callable[["AttentionSite"], bool] = _always
    proof_element: Callable[["AttentionSite", torch.Generator], None] | None = None
    through_scores: bool = True
    families: Callable[["AttentionSite"], list[Family]] | None = None
    layer_valid: Callable[["nn.Module", torch.Generator | None, float], None] | None = None
    layer_families: Callable[["nn.Module"], list[Family]] | None = None
    projection: ProjectionRule | None = None
    count: Callable[[Any], dict[str, int]] | None = None
    near_families: Callable[["AttentionSite"], list[Family]] | None = None
    default: bool = False
    proof_order: int = 1000
    transform_order: int = 1000

    def claimed_by(self, site: "AttentionSite") -> bool:
        """Whether the certificate checks this sector on ``site``."""
        return self.lacking(site) is None and self.present(site)

    def prove(self, site: "AttentionSite", generator: torch.Generator) -> None:
        """The valid element the certificate applies."""
        if self.proof_element is not None:
            self.proof_element(site, generator)
        else:
            self.valid(site, generator, 0.5)


_SECTORS: dict[str, Sector] = {}
_CONTROLS: dict[str, Control] = {}
_GENERATION = [0]  # bumped on every change: proofs and long-lived gates see a registry that changed


def generation() -> int:
    """A counter that changes whenever a sector or a control is registered or removed."""
    return _GENERATION[0]


def register(sector: Sector) -> Sector:
    """Add ``sector`` to the registry (after the ones there); its name must be new.

    Raises:
        GaugeError: a name already taken, or a :class:`ProjectionRule` whose ``solver`` is neither a known
            solver name nor a callable.
    """
    if not isinstance(sector, Sector):
        raise GaugeError(f"register: expected a Sector, got {type(sector).__name__}")
    if sector.name in _SECTORS:
        raise GaugeError(f"register: a sector named {sector.name!r} is already registered; unregister it first")
    p = sector.projection
    if p is not None and not (callable(p.solver) or p.solver in SOLVERS):
        raise GaugeError(f"register: sector {sector.name!r}: projection solver {p.solver!r} is neither one of "
                         f"{SOLVERS} nor a factory")
    if p is not None and p.units not in ("sites", "lrm_layers"):
        raise GaugeError(f"register: sector {sector.name!r}: projection units={p.units!r} must be 'sites' or 'lrm_layers'")
    _SECTORS[sector.name] = sector
    _GENERATION[0] += 1
    return sector


def unregister(name: str) -> Sector:
    """Remove the sector ``name`` (and return it)."""
    if name not in _SECTORS:
        raise GaugeError(f"unregister: no sector named {name!r} (registered: {tuple(_SECTORS)})")
    _GENERATION[0] += 1
    return _SECTORS.pop(name)


def register_control(control_: Control) -> Control:
    """Add a named negative control (its name must be new, its group one of :data:`CONTROL_GROUPS`)."""
    if control_.name in _CONTROLS:
        raise GaugeError(f"register_control: a control named {control_.name!r} is already registered")
    if control_.group not in CONTROL_GROUPS:
        raise GaugeError(f"register_control: {control_.name!r}: group={control_.group!r} is not one of {CONTROL_GROUPS}")
    _CONTROLS[control_.name] = control_
    _GENERATION[0] += 1
    return control_


def unregister_control(name: str) -> Control:
    """Remove the named control ``name`` (and return it)."""
    if name not in _CONTROLS:
        raise GaugeError(f"unregister_control: no control named {name!r}")
    _GENERATION[0] += 1
    return _CONTROLS.pop(name)


def sectors() -> tuple[Sector, ...]:
    """Every registered sector, in registration order."""
    return tuple(_SECTORS.values())


def sector(name: str) -> Sector:
    """The sector ``name``; a :class:`GaugeError` listing the registered ones otherwise."""
    got = _SECTORS.get(name)
    if got is None:
        raise GaugeError(f"no sector named {name!r}; the registered sectors are {tuple(_SECTORS)}")
    return got


def controls() -> tuple[Control, ...]:
    """Every named control, grouped by :data:`CONTROL_GROUPS` (registration order within a group)."""
    return tuple(sorted(_CONTROLS.values(), key=lambda c: CONTROL_GROUPS.index(c.group)))


def control(name: str) -> Control:
    """The named control ``name``."""
    got = _CONTROLS.get(name)
    if got is None:
        raise GaugeError(f"no negative control named {name!r}; the registered ones are {tuple(_CONTROLS)}")
    return got


def run(name: str, site: "AttentionSite", generator: torch.Generator | None, log_scale: float = 0.5) -> str:
    """Apply the named control ``name`` to ``site`` where it applies (a no-op elsewhere); returns ``name``
    (what a sector's ``control`` reports)."""
    c = control(name)
    if c.needs(site):
        c.apply(site, generator, log_scale)
    return name


def in_proof_order() -> list[Sector]:
    """The sectors in the order the certificate checks them (and the families list them)."""
    return sorted(_SECTORS.values(), key=lambda s: s.proof_order)


def in_transform_order() -> list[Sector]:
    """The sectors in the order :func:`gaugeopt.random_gauge_transform` applies them."""
    return sorted(_SECTORS.values(), key=lambda s: s.transform_order)


def claimed(site: "AttentionSite") -> list[str]:
    """The sectors the certificate checks on ``site``, in its order."""
    return [s.name for s in in_proof_order() if s.claimed_by(site)]


# The projector's solvers (gaugeopt.projection maps each name to its implementation).
SOLVERS = ("dense", "diagonal", "internal", "bias_shift")
