"""What a run of the flat-direction meter costs, said before it starts: memory, refusals, progress.

:func:`gaugeopt.flat_directions` is dense: it holds the Jacobian ``J`` (outputs × parameters, float64)
from its first row to the end, and at its peak one more of — a reverse-mode chunk while ``J`` fills, the
``n×n`` Gram matrix with one factor of it, the subspace block with the Cholesky factor, the Rayleigh–Ritz
factors, or the attribution's bases. :func:`estimate_memory` adds these up (``n`` parameters, ``b`` the
subspace block: the nullity plus 48)::

    J                     8·rows·n                              held to the end
    + 4·8·chunk·n                                               one reverse-mode chunk (≤ 64 MiB of J): the
                                                                allocator keeps what it freed
    + the largest of      8·max(2n², n² + 3nb) + 96 MiB         Gram matrix and factor; factor and block
                          8·(2nb + 5b² + 2.5·c·b)               Rayleigh–Ritz: R, its SVD, the null basis,
                                                                ``c`` rows of ``J·V`` at a time
                          8·10·n·b                              attribution: null basis, spans, their SVDs
    + 64 MiB                                                    forwards, the rest

The constants are fitted to the peak resident memory of real runs (``benchmarks/flat_memory.py``; the
points are in ``benchmarks/results/flat_memory_cpu.md``): with ``b`` known, each measured peak lies
between ``1/MEMORY_FACTOR`` of the estimate and the estimate for runs that need half a GiB or more
(below that the fixed terms dominate and the estimate is up to twice the peak). Before the run ``b`` is
estimated (:func:`gaugeopt.flat.meter.preflight`) from the complete count (:func:`gaugeopt.gauge_dimension`,
the nullity on generic weights) or, with too little data, from the rank bound ``positions·d_model +
outputs·(d_model + 1)``, and the memory is checked again once the spectrum has counted the block.

:func:`check_memory` refuses a run whose estimate exceeds the memory available now (``MemAvailable`` of
``/proc/meminfo``), with what it needs and what to do; :class:`Progress` keeps a long run talking.

Example:
    >>> from gaugeopt.flat.cost import estimate_memory
    >>> # a 28,544-parameter GPT-2 (width 32, vocabulary 80), 117 sequences of 16 tokens: 149,760 logits
    >>> e = estimate_memory(28_544, 149_760, 16 * 80, block=3_000)
    >>> round(e.jacobian / 2**30, 1), round(e.peak / 2**30, 1)
    (31.8, 44.4)
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from gaugeopt.errors import GaugeError

__all__ = ["MemoryEstimate", "estimate_memory", "available_memory", "check_memory", "too_large_message", "Progress",
           "chunk_rows", "MEMORY_FACTOR"]

MEMORY_FACTOR = 1.5  # measured peak ≥ estimate / MEMORY_FACTOR on the calibration points ≥ 512 MiB (module docstring)
_JAC_PASS = 4.0  # × one reverse-mode chunk of J: its rows, the batched parameter gradients, their copies
_SPECTRUM_WORK = 96 << 20  # LAPACK's workspace for the LDLᵀ and Cholesky factorisations (measured 50–100 MiB)
_RITZ_CHUNKS = 2.5  # × one row chunk of J·V: the product, its stack with R, the QR's copy
_ATTRIBUTION = 10.0  # × n·b
_OVERHEAD = 64 << 20
_F8 = 8


def chunk_rows(n: int, budget: int = 1 << 26) -> int:
    """Rows of an ``(·, n)`` float64 block that fit in ``budget`` bytes (64 MiB)."""
    return max(1, budget // (_F8 * n))


@dataclass(frozen=True)
class MemoryEstimate:
    """What :func:`gaugeopt.flat_directions` will hold at its peak, in bytes above what the process
    holds before the call (:func:`estimate_memory`).

    Attributes:
        n_params, n_rows, block: ``J`` is ``n_rows × n_params``; ``block`` the subspace block ``b``.
        jacobian: ``J`` itself, held from the first row to the end.
        jacobian_pass, spectrum, ritz, attribution: the transient of each stage (module docstring); the
            pass's adds to the largest of the others.
        overhead: the rest.
    """

    n_params: int
    n_rows: int
    block: int
    jacobian: int
    jacobian_pass: int
    spectrum: int
    ritz: int
    attribution: int
    overhead: int

    @property
    def transient(self) -> int:
        return self.jacobian_pass + max(self.spectrum, self.ritz, self.attribution)

    @property
    def peak(self) -> int:
        # the reverse-mode chunks are freed before the spectrum, but below glibc's mmap threshold (up to 32 MiB)
        # freed blocks stay with the process: measured, the pass's memory adds to the later stages'
        return self.jacobian + self.transient + self.overhead

    def describe(self) -> str:
        n = self.n_params
        return (f"about {gib(self.peak)} of memory: the Jacobian {self.n_rows:,}×{n:,} in float64 ({gib(self.jacobian)}) "
                f"and at most {gib(self.transient)} more at once (the {n:,}×{n:,} Gram matrix is {gib(_F8 * n * n)}; "
                f"null-space block of {self.block:,})")


def gib(x: float) -> str:
    """Bytes as GiB (MiB below a quarter GiB)."""
    return f"{x / 2**30:.1f} GiB" if x >= 2**28 else f"{x / 2**20:.0f} MiB"


def estimate_memory(n_params: int, n_rows: int, rows_per_example: int, block: int | None = None) -> MemoryEstimate:
    """The memory :func:`gaugeopt.flat_directions` needs for ``n_params`` parameters, a Jacobian of
    ``n_rows`` rows (``rows_per_example`` per example) and a subspace block of ``block`` vectors (the
    nullity plus 48; default ``n/2 + 48``), in bytes above what the process holds before the call
    (module docstring: the model and where its constants come from)."""
    n = n_params
    b = min(n, n // 2 + 48 if block is None else block)
    chunk = min(rows_per_example, chunk_rows(n))
    ritz_rows = min(n_rows, max(chunk_rows(b), b))  # flat.r_factor's row chunk
    return MemoryEstimate(
        n_params=n, n_rows=n_rows, block=b, jacobian=_F8 * n_rows * n, jacobian_pass=int(_JAC_PASS * _F8 * chunk * n),
        spectrum=_F8 * max(2 * n * n, n * n + 3 * n * b) + _SPECTRUM_WORK,
        ritz=int(_F8 * (2 * n * b + 5 * b * b + _RITZ_CHUNKS * ritz_rows * b)),
        attribution=int(_ATTRIBUTION * _F8 * n * b), overhead=_OVERHEAD,
    )


def available_memory() -> int | None:
    """Bytes the system can give a process now without swapping: ``MemAvailable`` of ``/proc/meminfo``
    (Linux), else ``None`` (unknown: nothing is refused)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(need: MemoryEstimate, max_memory: float | None = None, held: int = 0) -> None:
    """Refuse a run whose estimate exceeds ``max_memory`` bytes, or, by default, the memory available
    now plus ``held`` (what the run already holds of its estimate: a second check in mid-run).

    Raises:
        GaugeError: how much the run needs, how much there is, and what to do.
    """
    if max_memory is None:
        now = available_memory()
        if now is None:
            return
        have, where = now + held, "available (MemAvailable" + (" plus what the run already holds)" if held else ")")
    else:
        have, where = max_memory, "allowed (max_memory)"
    if need.peak <= have:
        return
    raise GaugeError(
        f"flat_directions: this run needs {need.describe()}, and {gib(have)} is {where}. The Jacobian grows with "
        "parameters × outputs, the rest with parameters²: measure a smaller model of the same architecture (fewer "
        "layers, a smaller width and vocabulary: the symmetries are per layer), pass fewer example sequences (a "
        "position adds at most d_model directions; suggested_sequences() gives enough), or count at scale with "
        "gaugeopt.gauge_dimension(model, convention='complete') (gaugeopt count)"
    )


def too_large_message(n: int, max_params: int, need: MemoryEstimate | None = None) -> str:
    """Why the meter refuses a model of ``n`` parameters, and what to do instead."""
    cost = need.describe() if need is not None else f"at least {gib(2 * _F8 * n * n)} for the Gram matrix and a factor"
    return (
        f"flat_directions: the model has {n:,} parameters, more than max_params={max_params:,}: the meter forms the "
        f"Jacobian (outputs × parameters) and its Gram matrix in float64 — {cost} — and its time grows like "
        "outputs × parameters². Measure a small model of the same architecture (fewer layers, a smaller width and "
        "vocabulary: the symmetries are per layer), count at scale with gaugeopt.gauge_dimension(model, "
        "convention='complete') (gaugeopt count), or raise max_params: a run that does not fit in the memory "
        "available is refused anyway"
    )


class Progress:
    """Stage lines on stderr (or a callable), at most every ``every`` seconds.

    ``progress=None`` (the default) stays quiet while the run is short and starts reporting once it has
    taken ``after`` seconds; ``True`` or a callable report from the start; ``False`` never. A heartbeat
    thread repeats the current stage while one long step (the Gram matrix, a factorisation) runs, so a
    long run never goes silent; a callable is then also called from that thread. Call :meth:`close`.
    """

    def __init__(self, progress: bool | Callable[[str], None] | None, after: float = 10.0, every: float = 5.0) -> None:
        self.emit = progress if callable(progress) else (
            (lambda s: print(s, file=sys.stderr, flush=True)) if progress or progress is None else None)
        self.after = after if progress is None else 0.0
        self.t0 = self.last = time.perf_counter()
        self.every = every
        self.stage = "starting"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if self.emit is not None:
            self._beat = threading.Thread(target=self._heartbeat, name="flat_directions progress", daemon=True)
            self._beat.start()

    def _send(self, msg: str, now: float) -> None:
        self.emit(f"flat_directions: {msg} ({now - self.t0:.0f} s)")
        self.last = now

    def __call__(self, msg: str, force: bool = False) -> None:
        now = time.perf_counter()
        with self._lock:
            self.stage = msg
            if self.emit is not None and now - self.t0 >= self.after and (force or now - self.last >= self.every):
                self._send(msg, now)

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(0.5, self.every)):
            now = time.perf_counter()
            with self._lock:
                if now - self.t0 >= self.after and now - self.last >= self.every:
                    self._send(f"{self.stage} ...", now)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
