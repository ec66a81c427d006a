"""Multi-head latent attention (MLA, DeepSeek-V2/V3): its shared RoPE key and its latent spaces.

An MLA layer (docs/mla.md) computes, for ``h`` heads, a no-RoPE width ``n``, a RoPE width ``r``
and a value width ``d_v``::

    c_q = W_qa x + b_qa,       q_i = W_qb[i] (γ_q ⊙ ĉ_q)          (or q_i = W_q[i] x without a query latent)
    [c_kv; k_pe] = W_kva x + b_kva,   [k_i; v_i] = W_kvb[i] (γ_kv ⊙ ĉ_kv)
    score_i(t, u) = q_i^nope(t)·k_i(u) + R_t q_i^rope(t) · R_u k_pe(u)
    y = Σ_i W_O[:, i] Σ_u α_i(t, u) v_i(u) + b_O

with ``ĉ = c / rms(c)`` (an RMSNorm with gain ``γ``). The record of such a layer is an ordinary
:class:`~gaugeopt.AttentionSite` for the *no-RoPE part* — query rows ``W_qb[i][:n]``, key rows
``W_kvb[i][:n]``, value rows ``W_kvb[i][n:]``, output columns, no RoPE, ``d_k = n`` — carrying a
:class:`LatentAttention` with the rest:

======================  =========================================  ===================================
field                   tensors (canonical view)                   gauge (this module's action)
======================  =========================================  ===================================
``q_rope``, ``k_rope``  query rows ``W_qb[i][n:]`` ``(h, r, m_q)``;  ``qk_rope``: ``q_i ← Bᵀq_i`` for every
                        the shared key rows of ``W_kva``             head, ``k_pe ← B⁻¹k_pe``; ``B`` in the
                        ``(1, r, d)`` (biases alike)                 RoPE commutant (:func:`act_qk_rope`)
``q_latent``,           the down-projection rows ``(L, d)`` and     ``latent_rotation``: ``W_down ← M W_down``,
``kv_latent``           bias ``(L,)``, the norm's gain ``(L,)``,     ``W_up ← W_up D Mᵀ D⁻¹``, ``M ∈ O(L)``
(:class:`LatentNorm`)   the up-projection ``(m, L)`` (all its rows)  (:func:`rotate_latent`); ``latent_gain``:
                                                                   ``γ ← γ ⊙ e``, ``W_up ← W_up diag(e)⁻¹``
                                                                   (:func:`scale_latent_gain`)
======================  =========================================  ===================================

(``D = diag(γ)``.) The RoPE part is a multi-query pair: one group, all ``h`` query heads against
one key, so the pair ``"qk_rope"`` (:meth:`gaugeopt.AttentionSite.pair`) has ``groups = 1`` and
its query side repeats ``h`` times. An RMSNorm commutes with rotations (``rms(Mc) = rms(c)``) and
with nothing else that is linear (a scale is undone only up to its ``ε``), so the latent keeps
``O(L)`` and the diagonal gain-against-column rescale, not ``GL(L)``. Head permutations move the
RoPE query rows with the rest of their head (:func:`gaugeopt.transforms.permute_heads`).

Example:
    >>> import torch, transformers, gaugeopt
    >>> cfg = transformers.DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
    ...     qk_nope_head_dim=4, v_head_dim=4, first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1,
    ...     n_group=1, topk_group=1)
    >>> site = gaugeopt.find_attention(transformers.DeepseekV3ForCausalLM(cfg))[0]
    >>> (site.h, site.d_k, site.d_v, site.latent.rope.kind, site.latent.q_rope.shape, site.latent.k_rope.shape)
    (2, 4, 4, 'interleaved', (2, 4, 8), (1, 4, 16))
    >>> rope = site.pair("qk_rope")
    >>> rope.groups, rope.a.repeat, [lat.width for lat in site.latent.latents()]
    (1, 2, [8, 8])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.records.rope import RopeSpec, commutator_size

if TYPE_CHECKING:  # pragma: no cover
    from gaugeopt.records.site import AttentionSite, TensorRef

__all__ = [
    "LATENT_SECTORS", "LatentNorm", "LatentAttention", "act_qk_rope", "rotate_latent", "scale_latent_gain",
    "latent_dims", "check_latent",
]

# the sectors whose actions this module defines (registered with the rest in gaugeopt.sectors.latents)
LATENT_SECTORS = ("qk_rope", "latent_rotation", "latent_gain")


@dataclass(frozen=True)
class LatentNorm:
    """One compressed latent ``c = W_down x + b`` read through an RMSNorm ``γ ⊙ c / rms(c)`` by an up-projection.

    Attributes:
        name: ``"q"`` or ``"kv"``.
        down: the latent's rows of the down-projection, canonical ``(L, d)`` (for the key–value latent
            the first ``L`` rows of ``W_kva``; its last ``r`` rows are the shared RoPE key).
        down_bias: their bias ``(L,)``, or ``None``.
        gain: the RMSNorm's gain ``(L,)`` (the gain is ``gain_offset + stored``).
        up: the whole up-projection weight, canonical ``(m, L)``: a latent gauge acts on its columns.
        eps: the RMSNorm's epsilon.
        gain_offset: the stored gain's offset (litgpt's ``add_unit_offset``: 1).
    """

    name: str
    down: "TensorRef"
    down_bias: "TensorRef | None"
    gain: "TensorRef"
    up: "TensorRef"
    eps: float = 1e-6
    gain_offset: float = 0.0

    @property
    def width(self) -> int:
        """``L``, the latent's width."""
        return self.gain.shape[0]

    def refs(self) -> Iterator[tuple[str, "TensorRef"]]:
        """``("<name>_latent.down", ref)``, ``...down_bias``, ``...gain``, ``...up`` (those present)."""
        for role, ref in (("down", self.down), ("down_bias", self.down_bias), ("gain", self.gain), ("up", self.up)):
            if ref is not None:
                yield f"{self.name}_latent.{role}", ref

    def effective_gain(self) -> torch.Tensor:
        """``gain_offset + gain`` (a detached view or new tensor)."""
        g = self.gain.get().detach()
        return g + self.gain_offset if self.gain_offset else g


@dataclass(frozen=True)
class LatentAttention:
    """The parts of a multi-head latent attention layer beyond its no-RoPE record (module docstring).

    Attributes:
        q_rope: the RoPE query rows of every head, canonical ``(h, r, m_q)`` (``m_q``: the query
            latent's width, or ``d`` without one).
        q_rope_bias: their bias ``(h, r)`` (litgpt's ``q_b_proj`` bias), or ``None``.
        k_rope: the shared RoPE key rows of the key–value down-projection, canonical ``(1, r, d)``.
        k_rope_bias: their bias ``(1, r)``, or ``None``.
        rope: how RoPE pairs the ``r`` coordinates (``rotary_dim = r``: the whole RoPE part rotates).
        kv_latent: the key–value latent (:class:`LatentNorm`).
        q_latent: the query latent, or ``None`` (a plain query projection: DeepSeek-V2-Lite).
    """

    q_rope: "TensorRef"
    q_rope_bias: "TensorRef | None"
    k_rope: "TensorRef"
    k_rope_bias: "TensorRef | None"
    rope: RopeSpec
    kv_latent: LatentNorm
    q_latent: LatentNorm | None = None

    @property
    def r(self) -> int:
        """``qk_rope_head_dim``."""
        return self.k_rope.shape[1]

    def latents(self) -> tuple[LatentNorm, ...]:
        """The latents present: the query latent (if any), then the key–value latent."""
        return tuple(x for x in (self.q_latent, self.kv_latent) if x is not None)

    def latent(self, name: str) -> LatentNorm:
        for lat in self.latents():
            if lat.name == name:
                return lat
        raise GaugeError(f"no {name!r} latent here (the latents present: {[x.name for x in self.latents()]})")

    def refs(self) -> Iterator[tuple[str, "TensorRef"]]:
        for role, ref in (("q_rope.weight", self.q_rope), ("q_rope.bias", self.q_rope_bias),
                          ("k_rope.weight", self.k_rope), ("k_rope.bias", self.k_rope_bias)):
            if ref is not None:
                yield role, ref
        for lat in self.latents():
            yield from lat.refs()


def check_latent(site: "AttentionSite") -> None:
    """Raise :class:`GaugeError` unless ``site.latent``'s canonical shapes fit the site's heads and widths."""
    lat = site.latent
    r = lat.k_rope.shape[1] if len(lat.k_rope.shape) == 3 else -1
    m_q = site.q.weight.shape[-1]
    want = {
        "q_rope.weight": (lat.q_rope, (site.h, r, m_q)),
        "q_rope.bias": (lat.q_rope_bias, (site.h, r)),
        "k_rope.weight": (lat.k_rope, (1, r, None)),
        "k_rope.bias": (lat.k_rope_bias, (1, r)),
    }
    for x in lat.latents():
        L = x.width
        want[f"{x.name}_latent.down"] = (x.down, (L, None))
        want[f"{x.name}_latent.down_bias"] = (x.down_bias, (L,))
        want[f"{x.name}_latent.gain"] = (x.gain, (L,))
        want[f"{x.name}_latent.up"] = (x.up, (None, L))
    for role, (ref, shape) in want.items():
        if ref is None:
            continue
        if len(ref.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, ref.shape)):
            raise GaugeError(f"{site.name}: latent {role} ({ref.name}) has canonical shape {ref.shape}, expected "
                             f"{tuple('*' if w is None else w for w in shape)}")
    if lat.rope.rotary_dim != r:
        raise GaugeError(f"{site.name}: the RoPE part has {r} coordinates but its RopeSpec rotates {lat.rope.rotary_dim}; "
                         "multi-head latent attention rotates the whole RoPE part")
    if lat.kv_latent.name != "kv" or (lat.q_latent is not None and lat.q_latent.name != "q"):
        raise GaugeError(f"{site.name}: the latents must be named 'q' and 'kv'")
    if site.k.weight.shape[-1] != lat.kv_latent.width or site.v.weight.shape[-1] != lat.kv_latent.width:
        raise GaugeError(f"{site.name}: the key and value rows read {site.k.weight.shape[-1]} latent channels, the "
                         f"key–value latent has {lat.kv_latent.width}")
    if lat.q_latent is not None and m_q != lat.q_latent.width:
        raise GaugeError(f"{site.name}: the query rows read {m_q} channels, the query latent has {lat.q_latent.width}")


def latent_dims(L_q: int | None, L_kv: int, r: int) -> dict[str, int]:
    """Dimensions of the sectors this module adds to one layer: ``qk_rope`` ``r`` (the RoPE commutant of
    one multi-query pair), ``latent_rotation`` ``Σ L(L−1)/2``, ``latent_gain`` ``Σ L`` over the latents."""
    widths = [L for L in (L_q, L_kv) if L]
    return {"qk_rope": r, "latent_rotation": sum(L * (L - 1) // 2 for L in widths), "latent_gain": sum(widths)}


# ---------------------------------------------------------------------- actions
def _latent_of(site: "AttentionSite"):
    if site.latent is None:
        raise GaugeError(f"{site.name} is not multi-head latent attention: it has no shared RoPE key and no latent "
                         "spaces (kinds 'qk_rope', 'latent_rotation', 'latent_gain' apply to MLA layers only)")
    return site.latent


def _check_commutes(site: "AttentionSite", rope: RopeSpec, B: torch.Tensor, what: str) -> None:
    if commutator_size(rope, rope.rotary_dim, B) > 1e-10:
        raise GaugeError(
            f"{site.name}: {what} does not commute with the RoPE rotations of the shared key ({rope.kind}, "
            f"rotary_dim={rope.rotary_dim}); the RoPE part's gauge is a·I + b·J on each plane"
        )


@torch.no_grad()
def act_qk_rope(site: "AttentionSite", B: torch.Tensor, *, B_inv: torch.Tensor | None = None,
                per_head: torch.Tensor | None = None, check: bool = True) -> None:
    """The RoPE part's gauge: ``q_i^rope ← Bᵀ q_i^rope`` for every head (biases alike), ``k_pe ← B⁻¹ k_pe``.

    Args:
        B: ``(1, r, r)``, in the RoPE commutant (``check`` refuses anything else).
        B_inv: the factor applied to the shared key instead of ``B⁻¹`` (invalid controls only).
        per_head: ``(h, r, r)`` factors applied to the query heads instead of ``B`` (invalid controls only).
    """
    lat = _latent_of(site)
    r = lat.r
    if tuple(B.shape) != (1, r, r):
        raise GaugeError(f"act_qk_rope: B has shape {tuple(B.shape)}, expected (1, {r}, {r})")
    if check:
        _check_commutes(site, lat.rope, B, "B")
    q = lat.q_rope.get()
    Bq = (B if per_head is None else per_head).to(q).mT
    q.copy_(Bq @ q)
    if lat.q_rope_bias is not None:
        b = lat.q_rope_bias.get()
        b.copy_((Bq @ b[..., None])[..., 0])
    K = (torch.linalg.inv(B) if B_inv is None else B_inv).to(q)
    k = lat.k_rope.get()
    k.copy_(K @ k)
    if lat.k_rope_bias is not None:
        b = lat.k_rope_bias.get()
        b.copy_((K @ b[..., None])[..., 0])


@torch.no_grad()
def rotate_latent(site: "AttentionSite", name: str, M: torch.Tensor, *, check: bool = True) -> None:
    """``W_down ← M W_down`` (and its bias), ``W_up ← W_up D M⁻¹ D⁻¹`` with ``D = diag(γ)``.

    For ``M ∈ O(L)`` (``M⁻¹ = Mᵀ``) the RMSNorm maps ``M c`` to ``M ĉ``, so the up-projection sees the
    same vector: a symmetry. ``check`` refuses any other ``M`` (an invertible non-orthogonal one
    changes ``rms(c)`` and with it the function — the ``latent_gl`` control)."""
    lat = _latent_of(site).latent(name)
    L = lat.width
    if tuple(M.shape) != (L, L):
        raise GaugeError(f"rotate_latent: M has shape {tuple(M.shape)}, expected ({L}, {L})")
    if check:
        err = (M.mT @ M - torch.eye(L, dtype=M.dtype, device=M.device)).abs().amax()
        if float(err) > 1e-10:
            raise GaugeError(
                f"{site.name}: the {name} latent's factor is not orthogonal (|MᵀM − I| = {float(err):.1e}); an RMSNorm "
                "commutes with rotations only, so any other M changes the normalised latent"
            )
    Minv = M.mT if check else torch.linalg.inv(M)
    down = lat.down.get()
    M_ = M.to(down)
    down.copy_(M_ @ down)
    if lat.down_bias is not None:
        b = lat.down_bias.get()
        b.copy_(M_ @ b)
    up = lat.up.get()
    D = lat.effective_gain().to(up)
    up.copy_((up * D[None, :]) @ Minv.to(up) / D[None, :])


@torch.no_grad()
def scale_latent_gain(site: "AttentionSite", name: str, e: torch.Tensor, *, move_columns: bool = True) -> None:
    """``γ ← γ ⊙ e`` (stored ``(offset + g)·e − offset``), ``W_up[:, c] ← W_up[:, c] / e_c``.

    ``move_columns=False`` leaves the up-projection alone (the ``latent_gain_alone`` control)."""
    lat = _latent_of(site).latent(name)
    if tuple(e.shape) != (lat.width,):
        raise GaugeError(f"scale_latent_gain: e has shape {tuple(e.shape)}, expected ({lat.width},)")
    g = lat.gain.get()
    e_ = e.to(g)
    g.copy_((g + lat.gain_offset) * e_ - lat.gain_offset if lat.gain_offset else g * e_)
    if move_columns:
        up = lat.up.get()
        up.div_(e_.to(up)[None, :])
