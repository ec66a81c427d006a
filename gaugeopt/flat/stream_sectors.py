"""The exact symmetries beyond attention: norms, the residual stream, the MLP.

Each sector is a :class:`~gaugeopt.flat.symmetries.Family` — a name, a dimension and a finite action ``t ↦ g(t)`` (``t = 0``
is the identity) that moves the parameters of one model in place — built on the model's
:class:`~gaugeopt.flat.stream.ResidualStream`. Notation: effective weights in ``(out, in)``
layout; LayerNorm ``LN(x) = γ ⊙ x̂ + β`` with ``x̂ = Px/σ(x)``, ``P = I − 11ᵀ/d``, so ``1ᵀx̂ = 0``;
RMSNorm ``γ ⊙ x/rms(x)``; a *reader* of a norm is a linear layer fed by it, a *writer* adds to the
stream (:meth:`~gaugeopt.flat.stream.ResidualStream.writers`, the embeddings).

====================  ==========================================================  =====================================
sector                finite action                                               why exact (when)
====================  ==========================================================  =====================================
``norm_gain``         ``γ ← γ⊙eᵗ``, ``β ← β⊙eᵗ``, every reader ``W ← W diag(e⁻ᵗ)``  readers see ``W diag(γ) x̂ + Wβ``
                                                                                  (not the final norm of a tied head)
``norm_bias``         ``β += δ``; a biased reader ``b −= Wδ``, an unbiased one     ``β`` enters only through ``Wβ + b``;
                      ``W += u⊗γ⁻¹`` with ``u = −Wδ / Σ((β+δ)/γ)``                 ``(u⊗γ⁻¹)(γ⊙x̂) = u·1ᵀx̂ = 0``
``norm_meanfree``     a reader ``W += t⊗γ⁻¹`` (``b −= t·Σβ/γ`` with a bias)         ``W diag(γ)`` acts on ``1^⊥`` only;
                                                                                  LayerNorm, no ``β`` or a biased reader
``residual_ones``     every writer ``X ← X + 1vᵀ`` (an embedding row ``+a·1``,      every reader of the stream is a
                      ``W_O``, ``W_down`` ``+1vᵀ``, their biases ``+c·1``)            LayerNorm, which removes the mean
``embedding_shift``   ``wte += 1⊗c``, ``wpe −= 1⊗c``                                ``wte[t] + wpe[p]`` unchanged; tied head:
                                                                                  ``c ∝ γ_f⁻¹`` only, and no ``β_f``
``mlp_scale``         ``W_up[c], b_up[c] ← eᵗ·(…)``, ``W_down[:, c] ← e⁻ᵗ·(…)``        ``act(gate)·up`` is linear in ``up``
                                                                                  (SwiGLU, GeGLU); ReLU is positively
                                                                                  homogeneous
``residual_rotation`` writers ``X ← RX``; readers ``W ← W D Rᵀ D⁻¹``,                 ``x̂(Rx) = R x̂(x)`` for ``R ∈ SO(d)``
                      ``β ← D R D⁻¹ β`` (``D = diag γ`` of their norm;              (RMSNorm) fixing ``1`` (LayerNorm);
                      readers without a norm ``W Rᵀ``)                               only with an *untied* head and no
                                                                                  post-norms
``router_shift``      a top-k router ``W_r += 1⊗w``, ``b_r += c·1``                   every expert's logit moves by
                                                                                  ``w·y + c``: the top-k choice and
                                                                                  the softmax over it are unchanged
``expert_up_scale``   gpt-oss, per expert unit ``u``: ``W_up[u] ← eᵗ W_up[u]``,        ``(up + 1)·glu`` scales by ``eᵗ``;
                      ``b_up[u] ← eᵗ(b_up[u] + 1) − 1``, ``W_down[:, u] ← e⁻ᵗ(…)``    exact while ``|up| < limit``
                                                                                  (the clamp inactive)
====================  ==========================================================  =====================================

In a mixture of experts (gpt-oss) the readers of ``norm2`` are the router and every expert's input
projection, its writers every expert's output projection. gpt-oss's experts compute
``(clamp(up, ±L) + 1) · g·σ(αg)`` with ``g = min(gate, L)``: the gate admits no rescale, and the up side
only the affine one above (``up + 1`` scaled), which is exact wherever the clamp is inactive —
on generic small weights everywhere, so the Jacobian's null space contains it — and broken on
tokens whose ``|up|`` reaches ``L`` (``swiglu_limit``, 7 in gpt-oss): a symmetry of the region a
model computes in, not of every input.

A tied head is the token embedding: it is rotated as a writer but would have to become
``wte D_f Rᵀ D_f⁻¹`` as the final norm's reader, so with a non-uniform ``γ_f`` the rotations are
not symmetries (paper 003 counts them; docs/errata.md). Neither are they where the blocks normalise
their outputs before adding them (OLMo 2, Gemma 3): ``R·(γ ⊙ ν(y))`` would have to be a norm's output
``γ′ ⊙ ν(y′)``, which needs ``R diag(γ) = diag(γ′) R′`` — for a generic ``γ`` only signed permutations.
The family is still built, with ``exact=False``, so that :func:`gaugeopt.flat_directions` can show how
far from flat it is.

**Gains with an offset** (Gemma's ``1 + w``): every family acts on the effective gain ``γ = 1 + w``
(:meth:`~gaugeopt.flat.stream.StreamNorm.read_gain`); the post-norms have no family (their gains
are read by nothing but the stream).

What none of these covers: the norms' ``ε`` breaks the global rescale of the stream (all writers
``× s``): a near-symmetry, not a symmetry (the meter sees it just above its tolerance). A model whose
norms compute in float32 inside a float64 model (Hugging Face's ``LlamaRMSNorm``) is exact only to
float32 rounding.

Example:
    >>> import copy, torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.invariance import randomize_parameters
    >>> from gaugeopt.flat.stream import find_stream
    >>> from gaugeopt.flat.stream_sectors import stream_families
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)).double().eval()
    >>> randomize_parameters(model, torch.Generator().manual_seed(0))
    >>> x = torch.randint(0, 32, (2, 8))
    >>> moved = copy.deepcopy(model)
    >>> fams = stream_families(find_stream(moved))
    >>> sorted({f.name for f in fams if f.exact})
    ['norm_bias', 'norm_gain', 'norm_meanfree', 'residual_ones']
    >>> for f in fams:
    ...     if f.exact:
    ...         f.apply(0.3 * torch.randn(f.dim, dtype=torch.float64))
    >>> gaugeopt.relative_change(model(x)[0], moved(x)[0]) < 1e-12
    True
"""

from __future__ import annotations

import math

import torch

from gaugeopt.flat.stream import ResidualStream, StreamLinear, StreamNorm
from gaugeopt.sectors.registry import Family

__all__ = ["STREAM_SECTORS", "stream_families", "rotation_basis"]

STREAM_SECTORS = ("norm_gain", "norm_bias", "norm_meanfree", "residual_ones", "embedding_shift", "mlp_scale",
                  "residual_rotation", "router_shift", "expert_up_scale")


def _get(ref) -> torch.Tensor:
    return ref.get().detach().clone()


@torch.no_grad()
def _set(ref, value: torch.Tensor) -> None:
    ref.get().copy_(value)


def rotation_basis(d: int, fix_ones: bool, dtype=torch.float64) -> torch.Tensor:
    """A basis ``(n, d, d)`` of the rotations' Lie algebra: ``so(d)`` (``n = d(d−1)/2``), or with
    ``fix_ones`` the rotations of ``1^⊥`` (``n = (d−1)(d−2)/2``)."""
    if fix_ones:
        ones = torch.full((d, 1), d**-0.5, dtype=dtype)
        q, _ = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=dtype)[:, : d - 1]], 1))
        U = q[:, 1:]
    else:
        U = torch.eye(d, dtype=dtype)
    k = U.shape[1]
    out = []
    for a in range(k):
        for b in range(a + 1, k):
            E = torch.zeros(k, k, dtype=dtype)
            E[a, b], E[b, a] = 1.0, -1.0
            out.append(U @ E @ U.T)
    return torch.stack(out) if out else torch.zeros(0, d, d, dtype=dtype)


# ---------------------------------------------------------------------- the families
def _norm_gain(stream: ResidualStream, norm: StreamNorm) -> Family:
    readers = stream.readers(norm)

    def apply(t: torch.Tensor) -> None:
        s = torch.exp(t)
        norm.write_gain(norm.read_gain() * s)  # γ = offset + stored (Gemma's 1 + w)
        if norm.bias is not None:
            _set(norm.bias, _get(norm.bias) * s)
        for r in readers:
            w, _ = r.read()
            r.write(w / s[None, :])

    return Family("norm_gain", norm.name, stream.d_model, apply, True, "γ ⊙ then W: only W diag(γ) matters")


def _norm_bias(stream: ResidualStream, norm: StreamNorm) -> Family:
    readers = stream.readers(norm)

    def apply(t: torch.Tensor) -> None:
        beta, gamma = _get(norm.bias) + t, norm.read_gain()
        _set(norm.bias, beta)
        for r in readers:
            w, b = r.read()
            if b is not None:
                r.write(bias=b - w @ t)
            else:  # absorbed by the mean-free part of the rows: W += u⊗γ⁻¹ adds u·Σβ/γ to Wβ, nothing to Wγx̂
                u = -(w @ t) / (beta / gamma).sum()
                r.write(w + u[:, None] / gamma[None, :])

    return Family("norm_bias", norm.name, stream.d_model, apply, stream.norm == "layernorm",
                  "β enters only through Wβ + b")


def _norm_meanfree(norm: StreamNorm, reader: StreamLinear) -> Family:
    exact = norm.bias is None or reader.has_bias

    def apply(t: torch.Tensor) -> None:
        gamma = norm.read_gain()
        w, b = reader.read()
        bias = None
        if norm.bias is not None and b is not None:
            bias = b - t * (_get(norm.bias) / gamma).sum()
        reader.write(w + t[:, None] / gamma[None, :], bias)

    rows = reader.proj.weight.shape
    n = math.prod(rows[:-1])
    return Family("norm_meanfree", reader.name, n, apply, exact,
                  "W diag(γ) x̂ with 1ᵀx̂ = 0" + ("" if exact else ": moves Wβ (LayerNorm bias, reader without one)"))


def _ones_on_writer(writer: StreamLinear) -> Family:
    w0, b0 = writer.read()
    n_in = w0.shape[1]

    def apply(t: torch.Tensor) -> None:
        w, b = writer.read()
        writer.write(w + t[None, :n_in], None if b is None else b + t[-1])

    return Family("residual_ones", writer.name, n_in + (b0 is not None), apply, True, "LayerNorm removes the mean")


def _ones_on_rows(ref, name: str) -> Family:
    def apply(t: torch.Tensor) -> None:
        _set(ref, _get(ref) + t[:, None])

    return Family("residual_ones", name, ref.shape[0], apply, True, "LayerNorm removes the mean")


def _embedding_shift(stream: ResidualStream) -> Family:
    tok, pos, fnorm = stream.token_embedding, stream.position_embedding, stream.final_norm
    if not stream.tied:
        def apply(t: torch.Tensor) -> None:
            _set(tok, _get(tok) + t[None, :])
            _set(pos, _get(pos) - t[None, :])

        return Family("embedding_shift", "embeddings", stream.d_model, apply, True, "wte[t] + wpe[p] is unchanged")

    def apply_tied(t: torch.Tensor) -> None:
        c = t[0] / fnorm.read_gain()
        _set(tok, _get(tok) + c[None, :])
        _set(pos, _get(pos) - c[None, :])

    exact = stream.norm == "layernorm" and fnorm.bias is None
    return Family("embedding_shift", "embeddings", 1, apply_tied, exact,
                  "tied head: logits move by c·LN_f(h), zero for c = γ_f⁻¹" + ("" if exact else " only without β_f"))


def _mlp_scale(block) -> Family:
    up, down = block.up, block.down

    def apply(t: torch.Tensor) -> None:
        s = torch.exp(t)
        w, b = up.read()
        up.write(w * s[:, None], None if b is None else b * s)
        w, _ = down.read()
        down.write(w / s[None, :])

    n = math.prod(up.proj.weight.shape[:-1])
    return Family("mlp_scale", up.name, n, apply, True, "act(up)·… is positively homogeneous in up")


def _router_shift(router) -> Family:
    def apply(t: torch.Tensor) -> None:
        w, b = router.read()
        d = w.shape[1]
        router.write(w + t[None, :d], None if b is None else b + t[d])

    d = router.proj.weight.shape[-1]
    return Family("router_shift", router.name, d + router.has_bias, apply, True,
                  "a shift common to every expert's logit leaves top-k and its softmax unchanged")


def _expert_up_scale(block) -> Family:
    """gpt-oss's experts: rows ``1::2`` of ``gate_up`` are the up projection (module docstring)."""
    ins, outs = block.experts_in, block.experts_out
    f = ins[0].read()[0].shape[0] // 2

    def apply(t: torch.Tensor) -> None:
        c = torch.exp(t).reshape(len(ins), f)
        for e, (a, b) in enumerate(zip(ins, outs)):
            w, bias = a.read()
            w[1::2] = w[1::2] * c[e][:, None].to(w)
            if bias is not None:
                bias[1::2] = c[e].to(bias) * (bias[1::2] + 1) - 1
            a.write(w, bias)
            wd, _ = b.read()
            b.write(wd / c[e][None, :].to(wd))

    return Family("expert_up_scale", ins[0].name.rsplit("[", 1)[0], len(ins) * f, apply, True,
                  "(up + 1)·glu scales with up + 1 (exact while the clamp on up is inactive)")


def _rotation(stream: ResidualStream) -> Family:
    basis = rotation_basis(stream.d_model, stream.norm == "layernorm")
    exact = not stream.tied

    def apply(t: torch.Tensor) -> None:
        R = torch.linalg.matrix_exp(torch.einsum("k,kab->ab", t, basis.to(t.dtype)))
        for ref in (stream.token_embedding, stream.position_embedding):
            if ref is not None:
                _set(ref, _get(ref) @ R.T)
        for w_ in stream.writers():
            w, b = w_.read()
            w_.write(R.to(w) @ w, None if b is None else R.to(b) @ b)
        for r in stream.raw_readers():  # no norm between the stream and the reader: W Rᵀ
            w, _ = r.read()
            r.write(w @ R.T.to(w))
        for norm in stream.norms():
            gamma = norm.read_gain()
            M = (gamma[:, None] * R.T) / gamma[None, :]  # D Rᵀ D⁻¹
            for r in stream.readers(norm):
                w, _ = r.read()
                r.write(w @ M.to(w))
            if norm.bias is not None:  # β ← D R D⁻¹ β
                _set(norm.bias, ((gamma[:, None] * R) / gamma[None, :]) @ _get(norm.bias))

    what = "SO(d)" if stream.norm == "rmsnorm" else "SO(d) fixing 1"
    post = bool(stream.post_norms())
    exact = exact and not post
    why = ("" if exact else ": post-norms on the blocks' outputs: R·(γ ⊙ ν(y)) is not γ ⊙ ν(R′y) for a non-uniform γ"
           if post else ": the tied head would have to be wte·D_f Rᵀ D_f⁻¹ as the final norm's reader")
    return Family("residual_rotation", "model", basis.shape[0], apply, exact, what + why)


def stream_families(stream: ResidualStream) -> list[Family]:
    """Every stream sector of ``stream``'s model, one :class:`~gaugeopt.flat.symmetries.Family` per unit, exact ones first
    (the table in the module docstring says when each applies)."""
    out: list[Family] = []
    layer_norm = stream.norm == "layernorm"
    for norm in stream.norms():
        if not stream.readers(norm):
            continue  # the final norm of a tied head
        out.append(_norm_gain(stream, norm))
        if norm.bias is not None:
            out.append(_norm_bias(stream, norm))
        if layer_norm:
            out += [_norm_meanfree(norm, r) for r in stream.readers(norm)]
    if layer_norm:
        if stream.position_embedding is not None:
            out.append(_ones_on_rows(stream.position_embedding, stream.position_embedding.name))
        if not stream.tied:
            out.append(_ones_on_rows(stream.token_embedding, stream.token_embedding.name))
        out += [_ones_on_writer(w) for w in stream.writers()]
    if stream.position_embedding is not None and (not stream.tied or layer_norm):
        out.append(_embedding_shift(stream))
    if stream.activation in ("swiglu", "geglu", "relu"):
        out += [_mlp_scale(b) for b in stream.blocks]
    out += [_router_shift(b.router) for b in stream.blocks if b.router is not None]
    if stream.activation == "moe_clamped_swiglu":
        out += [_expert_up_scale(b) for b in stream.blocks]
    out.append(_rotation(stream))
    return sorted(out, key=lambda f: not f.exact)
