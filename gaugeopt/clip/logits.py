"""Maximum attention logits per query head, computed from the records on each layer's real inputs.

QK-Clip (:func:`gaugeopt.qk_clip`) and any study of attention-logit growth need, per layer and
query head ``i``, the largest logit of the batch

    m_i = max over b, t, and keys j allowed to query t of  scale · ⟨rot_t(q_{b,t,i}), rot_j(k_{b,j,g(i)})⟩

(``g(i) = i // (h/h_kv)`` its KV head; the terms are those of :mod:`gaugeopt.clip.scores`). A
fused kernel (SDPA, flash) never materialises the scores, so gaugeopt recomputes them: a forward
pre-hook on every attention module receives the module's real call — whatever kernel its forward
then uses — and rebuilds ``q`` and ``k`` from the record (:class:`~gaugeopt.AttentionSite`: the
effective ``W_Q``, ``W_K`` with biases and learnable multipliers, the QK-norm, the RoPE planes, the
GQA groups) and the score terms of the call (scale, RoPE angles, causal and padding masks, sliding
windows), in float32 at least (float64 for a float64 model) and with autocast off. The maximum is
over the pairs the softmax sees, *before* a soft cap (Gemma 2 applies ``c·tanh(s/c)`` after it;
``s`` is what QK-Clip scales). Scores are formed a batch chunk at a time (≤ 2^25 entries).

**Checked, not assumed.** The first time a module is read (per record structure), its call is
replayed in float64: the attention output rebuilt from the same reconstruction — scores, soft cap,
softmax, ``V``, ``W_O`` — must match the module's own output on that call (a float64 copy run
alone, as :func:`gaugeopt.certify` does) to ``1e-6`` relative, over the query rows that see a key.
A wrong scale, mask, RoPE table or norm fails with a :class:`~gaugeopt.GaugeError` naming the layer
and the change; families whose score terms gaugeopt does not read are refused
(:func:`~gaugeopt.clip.scores.score_call`). Softmax ignores a constant added to a whole row of
scores, so this check cannot see one; the readers add none (q·b_K is part of ``q·k`` here).

:class:`LogitTracker` keeps a running maximum over every forward while it is attached (the
training-loop integrations switch it on for the forwards of a step that will be clipped);
:func:`max_attention_logits` runs one forward under it.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    ...                       rope="split_half"))
    >>> m = gaugeopt.max_attention_logits(model, torch.randint(0, 64, (2, 16)))
    >>> sorted(m), tuple(m["transformer.h.0.attn"].shape)
    (['transformer.h.0.attn', 'transformer.h.1.attn'], (4,))
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from gaugeopt.distributed import is_dtensor
from gaugeopt.errors import GaugeError
from gaugeopt.sectors.group_actions import relative_change
from gaugeopt.trust.capture import _first_tensor, _snapshot, _to_float64
from gaugeopt.trust.proof import _rebind
from gaugeopt.trust.stamps import fingerprint
from gaugeopt.trust.gate import trusted_sites
from gaugeopt.clip.scores import ScoreCall, score_call
from gaugeopt.records.site import AttentionSite

__all__ = ["CHECK_TOL", "LogitTracker", "max_attention_logits", "call_maxima", "queries_keys", "check_reader"]

CHECK_TOL = 1e-6
_CHUNK = 2**25  # score entries formed at once
_CHECKED = "_gaugeopt_logits_checked"


# ---------------------------------------------------------------------- q and k from the record
def _project(site: AttentionSite, p: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, heads, T, width)``: projection ``p`` of ``x`` with the record's effective weight and bias."""
    ref = getattr(site, p).weight
    if is_dtensor(ref.param):
        raise GaugeError(f"attention logits: {site.name}: {ref.name} is sharded (a DTensor); measure the logits on an "
                         "unsharded model (DDP replicas are fine)")
    w, b = site.effective(p)  # (heads, width, d)
    heads, width = w.shape[0], w.shape[1]
    y = x.to(dtype) @ w.reshape(heads * width, -1).to(dtype).T
    if b is not None:
        y = y + b.reshape(-1).to(dtype)
    return y.unflatten(-1, (heads, width)).transpose(1, 2)


def _norm(site: AttentionSite, u: torch.Tensor, side: str) -> torch.Tensor:
    """The record's QK-norm on ``u: (B, heads, T, d_k)``: RMS ``u/sqrt(mean u² + ε)·(g + offset)`` or
    LayerNorm ``(u − ū)/sqrt(var + ε)·g + β``, over each head (``scope="head"``) or all heads (``"full"``)."""
    n = site.qk_norm
    b, heads, t, d = u.shape
    x = u.transpose(1, 2).reshape(b, t, 1, heads * d) if n.scope == "full" else u
    if n.kind == "layer":
        x = x - x.mean(-1, keepdim=True)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + n.eps)
    if n.scope == "full":
        x = x.reshape(b, t, heads, d).transpose(1, 2)
    gain, bias = (n.q_gain, n.q_bias) if side == "q" else (n.k_gain, n.k_bias)
    if gain is not None:
        x = x * (gain.get().detach().to(x.dtype) + n.gain_offset)[None, :, None, :]
    if bias is not None:
        x = x + bias.get().detach().to(x.dtype)[None, :, None, :]
    return x


def _rotate(site: AttentionSite, u: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Turn plane ``m = (p, q)`` of every head of ``u: (B, heads, T, d_k)`` by the call's angle."""
    planes = site.rope.planes(site.d_k)
    ip = torch.tensor([p for p, _ in planes], device=u.device)
    iq = torch.tensor([q for _, q in planes], device=u.device)
    cos, sin = (t.to(device=u.device, dtype=u.dtype)[:, None] for t in rope)  # (B|1, 1, T, r/2)
    xp, xq = u[..., ip], u[..., iq]
    out = u.clone()
    out[..., ip] = xp * cos - xq * sin
    out[..., iq] = xp * sin + xq * cos
    return out


def queries_keys(site: AttentionSite, sc: ScoreCall, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: (B, h, T_q, d_k)`` and ``k: (B, h_kv, T_k, d_k)`` as the layer's scores see them."""
    q, k = _project(site, "q", sc.x_q, dtype), _project(site, "k", sc.x_kv, dtype)
    norm_first = site.qk_norm is not None and site.qk_norm.before_rope
    if norm_first:
        q, k = _norm(site, q, "q"), _norm(site, k, "k")
    if site.rope.active:
        q, k = _rotate(site, q, sc.rope_q), _rotate(site, k, sc.rope_k)
    if site.qk_norm is not None and not norm_first:
        q, k = _norm(site, q, "q"), _norm(site, k, "k")
    return q, k


def _grouped_scores(site: AttentionSite, q: torch.Tensor, k: torch.Tensor, sc: ScoreCall,
                    rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``(b, h_kv, n_rep, T_q, T_k)`` of the batch rows ``rows`` and their ``allowed`` mask."""
    qg = q[rows].unflatten(1, (site.h_kv, site.n_rep))
    s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k[rows]) * sc.scale
    allowed = sc.allowed
    if allowed is not None:
        if allowed.shape[0] > 1:
            allowed = allowed[rows]
        if allowed.shape[1] > 1:
            allowed = allowed.unflatten(1, (site.h_kv, site.n_rep))
        else:
            allowed = allowed[:, :, None]
        allowed = allowed.to(s.device)
    return s, allowed


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


@torch.no_grad()
def call_maxima(site: AttentionSite, sc: ScoreCall, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(h,)``: the largest logit of each query head over one call (``-inf`` where nothing is allowed,
    NaN where the scores are NaN)."""
    dtype = dtype or _compute_dtype(sc.x_q)
    q, k = queries_keys(site, sc, dtype)
    b, t_q, t_k = q.shape[0], q.shape[2], k.shape[2]
    step = max(1, _CHUNK // max(1, site.h * t_q * t_k))
    out = torch.full((site.h,), -math.inf, dtype=dtype, device=q.device)
    for start in range(0, b, step):
        s, allowed = _grouped_scores(site, q, k, sc, slice(start, start + step))
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        out = torch.maximum(out, s.amax(dim=(0, 3, 4)).reshape(site.h))
    return out


# ---------------------------------------------------------------------- the check
def _reconstructed_output(site: AttentionSite, sc: ScoreCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output ``(B, T_q, d_out)`` rebuilt in float64 from the reconstruction, and
    ``(B, T_q)``: the query rows that see at least one key."""
    dt = torch.float64
    q, k = queries_keys(site, sc, dt)
    v = _project(site, "v", sc.x_v, dt)  # (B, h_kv, T_k, d_v)
    s, allowed = _grouped_scores(site, q, k, sc, slice(None))
    if sc.softcap is not None:
        s = sc.softcap * torch.tanh(s / sc.softcap)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    y = torch.einsum("bgrqk,bgkd->bgrqd", p, v).flatten(1, 2)  # (B, h, T_q, d_v)
    wo, bo = site.effective("o")  # (d_out, h, d_v)
    out = torch.einsum("bhqd,ohd->bqo", y, wo.to(dt))
    if bo is not None:
        out = out + bo.to(dt)
    if allowed is None:
        rows = torch.ones(out.shape[:2], dtype=torch.bool)
    else:
        rows = allowed.any(-1).flatten(1, 2).all(1).expand(out.shape[0], -1)
    return out, rows


def check_reader(site: AttentionSite, args: tuple, kwargs: dict) -> float | None:
    """Replay one recorded call in float64 and compare the reconstructed output with the module's own
    (module docstring) over the rows where the module's output is finite; returns the relative change
    (``None`` when no row is finite: nothing to compare), raises :class:`GaugeError` above :data:`CHECK_TOL`."""
    args64, kwargs64 = _to_float64(args), _to_float64(kwargs)
    module = copy.deepcopy(site.module).double().eval()
    with torch.no_grad():
        ref = _first_tensor(module(*args64, **kwargs64))
        out, rows = _reconstructed_output(_on(site, module), score_call(_on(site, module), args64, kwargs64))
    if ref is None:
        raise GaugeError(f"attention logits: {site.name} returned no tensor")
    if site.kind == "torch_mha" and not site.module.batch_first:
        ref = ref.transpose(0, 1)
    rows = rows.to(ref.device) & torch.isfinite(ref).all(-1)  # a padded row may be NaN in the model itself
    if not bool(rows.any()):
        return None
    change = relative_change(ref[rows], out[rows])
    if not change <= CHECK_TOL:
        raise GaugeError(
            f"attention logits: {site.name} ({site.kind}): the attention output rebuilt from the record and the call's "
            f"score terms differs from the module's own by {change:.1e} (> {CHECK_TOL:.0e}) in float64, so its logits "
            "cannot be read from the record; check the record (gaugeopt.certify) and the module's score scale, masks and "
            "RoPE table"
        )
    return change


def _on(site: AttentionSite, module: nn.Module) -> AttentionSite:
    return _rebind(site, module)


# ---------------------------------------------------------------------- the tracker
class LogitTracker:
    """Running maxima of every attention layer's logits over the forwards it sees.

    Args:
        sites: the records (:func:`gaugeopt.find_attention`).
        active: called at each forward; the layer is read only when it returns True (default:
            always). The integrations read only the forwards of a step that will be clipped.
        grad_only: read only forwards run with gradients enabled (training forwards; a validation
            loop under ``torch.no_grad`` is skipped).
        check: replay each module's first read call in float64 (module docstring) before the
            maxima are handed out; once per module and record structure.

    :meth:`pop` returns ``{name: (h,) float tensor}`` for the layers read since the last call and
    starts afresh; :attr:`calls` counts the reads. Use as a context manager, or :meth:`close`.
    """

    def __init__(self, sites: Sequence[AttentionSite], *, active: Callable[[], bool] | None = None,
                 grad_only: bool = False, check: bool = True) -> None:
        self.sites = list(sites)
        self.active = active
        self.grad_only = grad_only
        self.check = check
        self.calls: dict[str, int] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[AttentionSite, tuple, dict]] = {}
        self._handles = [s.module.register_forward_pre_hook(self._hook(s), with_kwargs=True) for s in self.sites]

    def _hook(self, site: AttentionSite):
        def hook(module, args, kwargs):
            if module is not site.module:  # a copy of the module (a certificate's rerun) carries the hook too
                return
            if (self.grad_only and not torch.is_grad_enabled()) or (self.active is not None and not self.active()):
                return
            self.read(site, args, kwargs)
        hook._gaugeopt_read_only = True  # it reads the call; the gate lets it pass, and the proof does not count it
        hook._gaugeopt_recorder = True
        return hook

    def read(self, site: AttentionSite, args: tuple, kwargs: dict) -> None:
        """Fold one call of ``site.module`` into the maxima (the hook calls this)."""
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        device = x.device.type if x is not None else "cpu"
        with torch.no_grad(), torch.autocast(device_type=device, enabled=False):
            sc = score_call(site, args, kwargs)
            if self.check and site.name not in self._pending and not _is_checked(site):
                self._pending[site.name] = (site, _snapshot(args, {}), _snapshot(kwargs, {}))
            m = call_maxima(site, sc)
        prev = self._max.get(site.name)
        self._max[site.name] = m if prev is None else torch.maximum(prev, m)
        self.calls[site.name] = self.calls.get(site.name, 0) + 1

    def run_checks(self) -> None:
        """Run the float64 replay of every module read for the first time (raises on a mismatch)."""
        pending, self._pending = self._pending, {}
        for site, args, kwargs in pending.values():
            if check_reader(site, args, kwargs) is not None:  # else: checked on a later call
                vars(site.module).setdefault(_CHECKED, set()).add(fingerprint(site))

    def pop(self) -> dict[str, torch.Tensor]:
        """The maxima since the last :meth:`pop` (after :meth:`run_checks`), and forget them."""
        self.run_checks()
        out, self._max = self._max, {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "LogitTracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_checked(site: AttentionSite) -> bool:
    return fingerprint(site) in vars(site.module).get(_CHECKED, ())


def max_attention_logits(model: nn.Module, *inputs: Any, sites: Sequence[AttentionSite] | None = None,
                         check: bool = True, **kwargs: Any) -> dict[str, torch.Tensor]:
    """Per attention layer and query head, the largest attention logit of ``model(*inputs, **kwargs)``.

    Runs the forward once without gradients (the model stays in its train or eval mode: call
    ``model.eval()`` first for a dropout-free measurement) and returns ``{layer name: (h,) tensor}``
    in float32 (float64 for a float64 model) on the model's device: the maximum over the batch,
    the positions and the keys each query may see of ``scale·q·k`` (module docstring). A head whose
    queries see no key gets ``-inf``; NaN weights give NaN.

    Args:
        model: any model whose attention :func:`gaugeopt.find_attention` describes.
        *inputs, **kwargs: the forward's arguments (a batch).
        sites: precomputed records (saves the module walk).
        check: replay each layer's call in float64 the first time (module docstring).

    Raises:
        GaugeError: a layer the forward did not call, a family whose score terms gaugeopt does not
            read, or a reconstruction that does not reproduce the module's output.
    """
    sites = trusted_sites(model, "max_attention_logits", sites=sites)  # the logits are read through the records
    with LogitTracker(sites, check=check) as tracker, torch.no_grad():
        model(*inputs, **kwargs)
    missing = [s.name for s in sites if s.name not in tracker.calls]
    if missing:
        raise GaugeError(f"max_attention_logits: the forward never called {', '.join(missing[:4])}; pass inputs that run "
                         "every attention layer")
    return tracker.pop()
