"""The residual stream of a decoder-only language model: what writes to it and what reads it.

The attention gauges (:mod:`gaugeopt.records.pair`, :mod:`gaugeopt.records.bias_sector`) live inside one
attention layer. The other exact symmetries of a transformer (:mod:`gaugeopt.flat.stream_sectors`)
act across the residual stream: a norm's gain against the linear layers that read the norm, the
all-ones direction that a LayerNorm removes from everything written to the stream, rotations of
the whole stream. They need the model's *stream structure*, which this module records:

==================  =====================================================================
role                tensors
==================  =====================================================================
writers             token and position embeddings (rows), each block's attention output
                    ``W_O, b_O`` and MLP output ``W_down, b_down`` (columns ``(d, ·)``);
                    in a mixture of experts every expert's ``W_down, b_down``
norms               per block ``norm1`` (read by Q, K, V), ``norm2`` (read by the MLP's
                    up and gate projections; by the router and every expert's input
                    projection in a mixture of experts), the final norm (read by the head)
readers             the linear layers right after a norm: ``W (out, d)`` and their biases;
                    without a pre-norm (OLMo 2) the projections read the stream itself
post-norms          a norm on a block's attention or MLP output before it is added
                    (``post1``, ``post2``: OLMo 2, Gemma 3's "sandwich")
head                ``(V, d)``: the token embedding itself when tied
==================  =====================================================================

Every linear is read and written through :class:`StreamLinear`, in effective terms
(``diag(r)·W̄·diag(c)`` and ``r ⊙ b̄`` under learnable multipliers), in the ``(out, in)`` layout of
``nn.Linear`` whatever the storage (HF ``Conv1D`` is transposed by its view).

:func:`find_stream` builds the record for the models whose forward it knows: gaugeopt's
:class:`~gaugeopt.models.gpt.GPT`, Hugging Face ``GPT2LMHeadModel``, the Llama family
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``), gpt-oss (``GptOssForCausalLM``:
a top-k router and stacked experts, activation ``"moe_clamped_swiglu"``), dense DeepSeek-V2/V3
(multi-head latent attention, whose down-projections are the readers of ``norm1``; docs/mla.md) and
the QK-norm families ``Qwen3ForCausalLM`` (Llama's blocks), ``Olmo2ForCausalLM`` (post-norms only)
and ``Gemma3ForCausalLM`` (pre- and post-norms, gains ``1 + w``, a scaled embedding, GeGLU).
Anything else is refused
with a :class:`~gaugeopt.errors.GaugeError`: a stream sector derived for one block layout (pre-norm,
a norm read only by linear layers) is not a symmetry of another. :class:`StreamShape` is the part a
count needs, from a model (:meth:`ResidualStream.shape`) or from a config (without weights,
:func:`gaugeopt.flat.counting.stream_shape`).

Example:
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.flat.stream import find_stream
    >>> s = find_stream(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)))
    >>> s.kind, s.norm, s.activation, s.tied, len(s.blocks), s.position_embedding.shape
    ('gpt', 'layernorm', 'gelu', True, 2, (16, 16))
    >>> [r.name for r in s.readers(s.blocks[0].norm1)]
    ['transformer.h.0.attn.c_attn[q]', 'transformer.h.0.attn.c_attn[k]', 'transformer.h.0.attn.c_attn[v]']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.linears import linear_like, projection_refs
from gaugeopt.adapters.find import find_attention
from gaugeopt.records.site import AttentionSite, ProjectionRefs, TensorRef

__all__ = ["NORMS", "ACTIVATIONS", "StreamLinear", "StreamNorm", "StreamBlock", "ResidualStream", "StreamShape",
           "find_stream"]

NORMS = ("layernorm", "rmsnorm")
# swiglu/geglu: act(W_gate y)·(W_up y), linear in W_up; "moe_clamped_swiglu": gpt-oss's experts,
# (clamp(up) + 1)·g·σ(αg) with g = clamp(gate): no rescale survives
ACTIVATIONS = ("gelu", "swiglu", "geglu", "relu", "moe_clamped_swiglu")


@dataclass(frozen=True)
class StreamLinear:
    """A linear map in effective ``(out, in)`` terms over a :class:`~gaugeopt.records.site.ProjectionRefs`.

    ``columns=False``: the projection's canonical view is ``(heads, width, in)`` (Q, K, V, an MLP or
    head linear as one "head"); ``columns=True``: ``(out, heads, width)`` (the attention output).
    """

    name: str
    proj: ProjectionRefs
    columns: bool = False

    @property
    def has_bias(self) -> bool:
        return self.proj.bias is not None

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1) if self.columns else t.reshape(-1, t.shape[-1])

    def _mults(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        r = None if self.proj.row_mult is None else self.proj.row_mult.get().reshape(-1)
        c = None if self.proj.col_mult is None else self.proj.col_mult.get().reshape(-1)
        return r, c

    def read(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Effective ``(W (out, in), b (out,) or None)``, new tensors."""
        w = self._flat(self.proj.weight.get().detach()).clone()
        r, c = self._mults()
        if r is not None:
            w = w * r.detach()[:, None]
        if c is not None:
            w = w * c.detach()[None, :]
        b = None
        if self.proj.bias is not None:
            b = self.proj.bias.get().detach().reshape(-1).clone()
            if r is not None:
                b = b * r.detach()
        return w, b

    @torch.no_grad()
    def write(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        """Write an effective weight and/or bias back (multipliers divided out)."""
        r, c = self._mults()
        if weight is not None:
            w = weight
            if r is not None:
                w = w / r[:, None]
            if c is not None:
                w = w / c[None, :]
            self.proj.weight.get().copy_(w.reshape(self.proj.weight.shape))
        if bias is not None:
            if self.proj.bias is None:
                raise GaugeError(f"{self.name}: has no bias to write")
            self.proj.bias.get().copy_((bias if r is None else bias / r).reshape(self.proj.bias.shape))


@dataclass(frozen=True)
class ExpertLinear:
    """One expert's slice of a stacked expert parameter (``(E, in, out)`` storage, ``x @ W[e] + b[e]``),
    read and written in effective ``(out, in)`` terms like :class:`StreamLinear`."""

    name: str
    owner: nn.Module
    weight: str
    bias: str | None
    index: int

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def read(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = getattr(self.owner, self.weight)[self.index].detach().T.clone()
        b = None if self.bias is None else getattr(self.owner, self.bias)[self.index].detach().clone()
        return w, b

    @torch.no_grad()
    def write(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        if weight is not None:
            getattr(self.owner, self.weight)[self.index].copy_(weight.T)
        if bias is not None:
            if self.bias is None:
                raise GaugeError(f"{self.name}: has no bias to write")
            getattr(self.owner, self.bias)[self.index].copy_(bias)


@dataclass(frozen=True)
class StreamNorm:
    """A norm on the residual stream: ``kind`` (``"layernorm"``/``"rmsnorm"``), its gain ``γ`` and
    LayerNorm bias ``β`` (``None`` without), ``eps``; ``offset``: the gain is ``offset + stored`` (Gemma's
    ``1 + w``)."""

    name: str
    kind: str
    gain: TensorRef
    bias: TensorRef | None
    eps: float
    offset: float = 0.0

    def read_gain(self) -> torch.Tensor:
        """The effective gain ``γ = offset + stored`` (a new tensor)."""
        return self.gain.get().detach() + self.offset

    @torch.no_grad()
    def write_gain(self, gamma: torch.Tensor) -> None:
        """Store the effective gain ``γ`` (the offset subtracted)."""
        self.gain.get().copy_(gamma - self.offset)


@dataclass(frozen=True)
class StreamBlock:
    """One block: ``x += post1(attn(norm1(x)))``, ``x += post2(mlp(norm2(x)))`` with
    ``mlp(y) = W_down·act(W_up y [, W_gate y])`` — or, in a mixture of experts (``up``, ``down``
    ``None``), ``mlp(y) = Σ_{e ∈ top-k(W_r y + b_r)} softmax(…)_e · down_e(act(up_e y))``: the
    ``router`` and the experts' input projections read ``norm2``, their output projections write. A
    missing norm (``None``) is the identity — a pre-norm block has no ``post1``/``post2``, OLMo 2 has no
    ``norm1``/``norm2``, Gemma 3 has all four."""

    attention: AttentionSite
    norm1: StreamNorm | None
    norm2: StreamNorm | None
    up: StreamLinear | None
    gate: StreamLinear | None
    down: StreamLinear | None
    router: StreamLinear | None = None
    experts_in: tuple[ExpertLinear, ...] = ()
    experts_out: tuple[ExpertLinear, ...] = ()
    post1: StreamNorm | None = None
    post2: StreamNorm | None = None

    def mlp_readers(self) -> list:
        if self.up is None:
            return [self.router, *self.experts_in]
        return [self.up] + ([self.gate] if self.gate is not None else [])

    def mlp_writers(self) -> list:
        return [self.down] if self.down is not None else list(self.experts_out)

    def attention_readers(self) -> list[StreamLinear]:
        s = self.attention
        if s.latent is not None:  # multi-head latent attention reads the stream through its down-projections
            lat = s.latent
            q = lat.q_latent.down if lat.q_latent is not None else s.q.weight
            return [_whole_linear(ref.owner, ref.name.rsplit(".", 1)[0]) for ref in (q, lat.k_rope)]
        base = s.q.weight.name.rsplit(".", 1)[0]
        same = s.k.weight.owner is s.q.weight.owner
        return [StreamLinear(f"{base}[{p}]" if same else getattr(s, p).weight.name.rsplit(".", 1)[0], getattr(s, p))
                for p in "qkv"]

    def attention_writer(self) -> StreamLinear:
        o = self.attention.o
        return StreamLinear(o.weight.name.rsplit(".", 1)[0], o, columns=True)


@dataclass(frozen=True)
class StreamShape:
    """What a count needs of the residual stream (no weights): widths, the norm and activation
    kinds, which tensors exist. Per-layer flags hold for every layer."""

    n_layer: int
    d_model: int
    d_ff: int
    vocab: int
    positions: int  # learned position embeddings (0: none, e.g. RoPE)
    norm: str
    activation: str
    tied: bool
    norm_bias: bool  # every norm has a LayerNorm bias β
    mlp_in_bias: bool  # W_up (and W_gate) have biases
    mlp_out_bias: bool
    head_bias: bool = False
    router_shift: int = 0  # per layer: the directions a top-k router's softmax ignores (d, + 1 with a bias)
    expert_units: int = 0  # per layer: hidden units over all experts (gpt-oss's affine up rescale, one each)
    pre_norms: bool = True  # each block reads the stream through a norm (False: OLMo 2)
    post_norms: bool = False  # each block normalises its outputs before adding them (OLMo 2, Gemma 3)


@dataclass
class ResidualStream:
    """The residual-stream record of one model (module docstring); :func:`find_stream` builds it.

    ``float32_steps`` says what the model computes in float32 even in a float64 model (Hugging
    Face's ``LlamaRMSNorm`` rounds the hidden states through float32), which bounds how exactly a
    stream symmetry can be observed (``""``: nothing)."""

    kind: str
    model: nn.Module
    norm: str
    activation: str
    token_embedding: TensorRef
    position_embedding: TensorRef | None
    blocks: list[StreamBlock]
    final_norm: StreamNorm
    head: StreamLinear | None  # None when tied: the head is token_embedding
    d_model: int
    d_ff: int
    vocab: int
    float32_steps: str = ""

    @property
    def tied(self) -> bool:
        return self.head is None

    def norms(self) -> list[StreamNorm]:
        """Every norm that linear layers read, in order: ``norm1, norm2`` of each block (where present),
        then the final norm. The post-norms (:meth:`post_norms`) are not among them."""
        return [n for b in self.blocks for n in (b.norm1, b.norm2) if n is not None] + [self.final_norm]

    def post_norms(self) -> list[StreamNorm]:
        """The norms on the blocks' outputs (``post1``, ``post2``), in order."""
        return [n for b in self.blocks for n in (b.post1, b.post2) if n is not None]

    def raw_readers(self) -> list[StreamLinear]:
        """The linear layers that read the stream with no norm before them (OLMo 2's projections)."""
        out: list[StreamLinear] = []
        for b in self.blocks:
            if b.norm1 is None:
                out += b.attention_readers()
            if b.norm2 is None:
                out += b.mlp_readers()
        return out

    def readers(self, norm: StreamNorm) -> list[StreamLinear]:
        """The linear layers that read ``norm`` (an empty list for the final norm of a tied head:
        the head is the token embedding, see :attr:`tied`)."""
        for b in self.blocks:
            if norm is b.norm1:
                return b.attention_readers()
            if norm is b.norm2:
                return b.mlp_readers()
        if norm is self.final_norm:
            return [] if self.head is None else [self.head]
        raise GaugeError(f"{norm.name} is not a norm of this stream")

    def writers(self) -> list[StreamLinear]:
        """The linear layers that add to the stream: each block's attention output and MLP output."""
        return [w for b in self.blocks for w in (b.attention_writer(), *b.mlp_writers())]

    def shape(self) -> StreamShape:
        b0 = self.blocks[0]
        router = 0 if b0.router is None else self.d_model + b0.router.has_bias
        units = sum(e.read()[0].shape[0] // 2 for e in b0.experts_in) if self.activation == "moe_clamped_swiglu" else 0
        return StreamShape(
            len(self.blocks), self.d_model, self.d_ff, self.vocab,
            0 if self.position_embedding is None else self.position_embedding.shape[0],
            self.norm, self.activation, self.tied, b0.norm1 is not None and b0.norm1.bias is not None,
            all(r.has_bias for r in b0.mlp_readers()), all(w.has_bias for w in b0.mlp_writers()),
            self.head is not None and self.head.has_bias, router, units, b0.norm1 is not None, b0.post1 is not None,
        )


# ---------------------------------------------------------------------- builders
def _linear(root: nn.Module, name: str) -> StreamLinear:
    m = root.get_submodule(name)
    _, out, inp = linear_like(m)
    return StreamLinear(name, projection_refs(m, name, rows=None, split=0, canon="in", heads=1, width=out, d_model=inp))


def _whole_linear(m: nn.Module, name: str) -> StreamLinear:
    _, out, inp = linear_like(m)
    return StreamLinear(name, projection_refs(m, name, rows=None, split=0, canon="in", heads=1, width=out, d_model=inp))


def _norm(root: nn.Module, name: str) -> StreamNorm:
    m = root.get_submodule(name)
    if type(m) is nn.LayerNorm:
        if not m.elementwise_affine:
            raise GaugeError(f"{name}: a LayerNorm without a gain; gaugeopt's stream sectors assume one")
        d = m.normalized_shape[0]
        bias = None if m.bias is None else TensorRef(m, "bias", f"{name}.bias", (d,))
        return StreamNorm(name, "layernorm", TensorRef(m, "weight", f"{name}.weight", (d,)), bias, float(m.eps))
    cls = type(m).__name__
    if cls == "RMSNorm" and type(m).__module__ == "gaugeopt.models.gpt" or cls in _HF_RMSNORMS:
        d = m.weight.shape[0]
        eps = float(getattr(m, "eps", getattr(m, "variance_epsilon", 0.0)))
        return StreamNorm(name, "rmsnorm", TensorRef(m, "weight", f"{name}.weight", (d,)), None, eps,
                          1.0 if cls == "Gemma3RMSNorm" else 0.0)
    raise GaugeError(f"{name}: norm of type {type(m).__qualname__} is not one gaugeopt's stream sectors know "
                     f"(nn.LayerNorm, gaugeopt's RMSNorm, {', '.join(_HF_RMSNORMS)})")


# the Hugging Face RMSNorms the stream knows (each γ ⊙ x / sqrt(mean x² + ε); Gemma's γ = 1 + w)
_HF_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "GptOssRMSNorm", "DeepseekV2RMSNorm",
                "DeepseekV3RMSNorm", "Qwen3RMSNorm", "Olmo2RMSNorm", "Gemma3RMSNorm")
_HF_LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_HF_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# the QK-norm families with other block layouts: (pre-norm names or None, post-norm names, activation config key)
_HF_POST_NORM = {
    "Olmo2ForCausalLM": (None, ("post_attention_layernorm", "post_feedforward_layernorm"), "hidden_act"),
    "Gemma3ForCausalLM": (("input_layernorm", "pre_feedforward_layernorm"),
                          ("post_attention_layernorm", "post_feedforward_layernorm"), "hidden_activation"),
}
_GATED = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu": "geglu"}


def _embedding(root: nn.Module, name: str) -> TensorRef:
    m = root.get_submodule(name)
    if type(m) is not nn.Embedding and type(m).__name__ != "Gemma3TextScaledWordEmbedding":  # a constant scale
        raise GaugeError(f"{name}: expected nn.Embedding, got {type(m).__qualname__}")
    return TensorRef(m, "weight", f"{name}.weight", tuple(m.weight.shape))


def _head(root: nn.Module, name: str, embedding: TensorRef) -> StreamLinear | None:
    m = root.get_submodule(name)
    if m.weight is embedding.param:
        return None
    return _linear(root, name)


def _check_sites(sites: list[AttentionSite], blocks: list[nn.Module], attr: str, kind: str) -> list[AttentionSite]:
    by_module = {id(s.module): s for s in sites}
    out = []
    for i, b in enumerate(blocks):
        site = by_module.get(id(getattr(b, attr)))
        if site is None:
            raise GaugeError(f"{kind}: block {i} has no attention record (find_attention did not return its {attr})")
        out.append(site)
    return out


def find_stream(model: nn.Module) -> ResidualStream:
    """The :class:`ResidualStream` of ``model`` (gaugeopt's GPT, HF GPT-2, the Llama family).

    Raises:
        GaugeError: any other class (the stream sectors are derived for these block layouts), or an
            activation the sectors do not cover.
    """
    cls = type(model).__name__
    sites = find_attention(model)
    if cls == "GPT" and type(model).__module__ == "gaugeopt.models.gpt":
        cfg = model.config
        if cfg.dropout and model.training:
            raise GaugeError("find_stream: the model is in training mode with dropout; call model.eval()")
        blocks = list(model.transformer.h)
        atts = _check_sites(sites, blocks, "attn", "GPT")
        p = "transformer.h"
        sb = [StreamBlock(a, _norm(model, f"{p}.{i}.ln_1"), _norm(model, f"{p}.{i}.ln_2"), _linear(model, f"{p}.{i}.mlp.c_fc"),
                          _linear(model, f"{p}.{i}.mlp.c_gate") if cfg.mlp == "swiglu" else None,
                          _linear(model, f"{p}.{i}.mlp.c_proj")) for i, a in enumerate(atts)]
        tok = _embedding(model, "transformer.wte")
        pos = _embedding(model, "transformer.wpe") if "wpe" in model.transformer else None
        return ResidualStream("gpt", model, cfg.norm, cfg.mlp, tok, pos, sb, _norm(model, "transformer.ln_f"),
                              _head(model, "lm_head", tok), cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size)
    if cls == "GPT2LMHeadModel":
        cfg = model.config
        act = {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}.get(cfg.activation_function)
        if act is None:
            raise GaugeError(f"find_stream: GPT-2 with activation_function={cfg.activation_function!r}; the stream sectors "
                             "know GELU (no continuous MLP symmetry) and ReLU (a positive rescale per hidden unit)")
        blocks = list(model.transformer.h)
        atts = _check_sites(sites, blocks, "attn", "GPT2LMHeadModel")
        p = "transformer.h"
        sb = [StreamBlock(a, _norm(model, f"{p}.{i}.ln_1"), _norm(model, f"{p}.{i}.ln_2"), _linear(model, f"{p}.{i}.mlp.c_fc"),
                          None, _linear(model, f"{p}.{i}.mlp.c_proj")) for i, a in enumerate(atts)]
        tok = _embedding(model, "transformer.wte")
        d = cfg.n_embd
        return ResidualStream("hf_gpt2", model, "layernorm", act, tok, _embedding(model, "transformer.wpe"), sb,
                              _norm(model, "transformer.ln_f"), _head(model, "lm_head", tok), d, cfg.n_inner or 4 * d,
                              cfg.vocab_size)
    if cls in _HF_LLAMA_LIKE or cls in _HF_DEEPSEEK:
        cfg = model.config
        if cfg.hidden_act != "silu":
            raise GaugeError(f"find_stream: {cls} with hidden_act={cfg.hidden_act!r}; the stream sectors know SwiGLU (silu)")
        blocks = list(model.model.layers)
        if cls in _HF_DEEPSEEK:
            routed = [i for i, b in enumerate(blocks) if not type(b.mlp).__name__.endswith("MLP")]
            if routed:
                raise GaugeError(
                    f"find_stream: {cls} layers {routed} route tokens to experts ({type(blocks[routed[0]].mlp).__name__}); "
                    "gaugeopt derives the stream sectors for dense SwiGLU layers only (the router, its scores and the "
                    "experts' own rescalings are not derived). Count a dense configuration (first_k_dense_replace >= "
                    "num_hidden_layers), or use convention='wang' for the attention gauges alone"
                )
        atts = _check_sites(sites, blocks, "self_attn", cls)
        p = "model.layers"
        sb = [StreamBlock(a, _norm(model, f"{p}.{i}.input_layernorm"), _norm(model, f"{p}.{i}.post_attention_layernorm"),
                          _linear(model, f"{p}.{i}.mlp.up_proj"), _linear(model, f"{p}.{i}.mlp.gate_proj"),
                          _linear(model, f"{p}.{i}.mlp.down_proj")) for i, a in enumerate(atts)]
        tok = _embedding(model, "model.embed_tokens")
        norm_cls = type(model.model.norm)
        stock = getattr(norm_cls.forward, "__module__", "") == norm_cls.__module__  # not replaced by a float64 one
        return ResidualStream("hf_" + cls.removesuffix("ForCausalLM").lower(), model, "rmsnorm", "swiglu", tok, None, sb,
                              _norm(model, "model.norm"), _head(model, "lm_head", tok), cfg.hidden_size,
                              cfg.intermediate_size, cfg.vocab_size,
                              float32_steps=f"RMSNorm in float32 ({norm_cls.__name__} casts to float32 and back)" if stock else "")
    if cls == "GptOssForCausalLM":
        return _gpt_oss_stream(model, sites)
    if cls in _HF_POST_NORM:
        return _post_norm_stream(model, cls, sites)
    raise GaugeError(
        f"find_stream: no residual-stream description for {type(model).__qualname__}; the sectors beyond attention "
        "(norm gains, LayerNorm families, residual rotations, MLP rescales) are derived for gaugeopt's GPT, Hugging Face "
        "GPT2LMHeadModel, LlamaForCausalLM/MistralForCausalLM/Qwen2ForCausalLM/Qwen3ForCausalLM, GptOssForCausalLM, "
        "dense DeepseekV2/V3ForCausalLM, Olmo2ForCausalLM and Gemma3ForCausalLM"
    )


def _stock_rmsnorm_note(model: nn.Module) -> str:
    norm_cls = type(model.model.norm)
    stock = getattr(norm_cls.forward, "__module__", "") == norm_cls.__module__  # not replaced by a float64 one
    return f"RMSNorm in float32 ({norm_cls.__name__} casts to float32 and back)" if stock else ""


def _gpt_oss_stream(model: nn.Module, sites: list[AttentionSite]) -> ResidualStream:
    """gpt-oss: RMSNorm, a top-k router (``weight (E, d)``, ``bias (E,)``) and stacked experts
    (``gate_up_proj (E, d, 2f)`` read by ``norm2``, ``down_proj (E, f, d)`` writing), untied head."""
    cfg = model.config
    impl = getattr(cfg, "_experts_implementation", None)
    if impl not in (None, "eager"):
        raise GaugeError(f"find_stream: gpt-oss with config._experts_implementation={impl!r}; the stream record reads the "
                         "stacked expert parameters the 'eager' implementation uses (set it to 'eager')")
    blocks = list(model.model.layers)
    atts = _check_sites(sites, blocks, "self_attn", "GptOssForCausalLM")
    sb = []
    for i, a in enumerate(atts):
        p = f"model.layers.{i}.mlp"
        router_mod, experts = model.get_submodule(f"{p}.router"), model.get_submodule(f"{p}.experts")
        E, d = router_mod.weight.shape
        router = StreamLinear(f"{p}.router", ProjectionRefs(
            TensorRef(router_mod, "weight", f"{p}.router.weight", (1, E, d)),
            None if router_mod.bias is None else TensorRef(router_mod, "bias", f"{p}.router.bias", (1, E))))
        ins = tuple(ExpertLinear(f"{p}.experts.gate_up_proj[{e}]", experts, "gate_up_proj", "gate_up_proj_bias", e)
                    for e in range(experts.num_experts))
        outs = tuple(ExpertLinear(f"{p}.experts.down_proj[{e}]", experts, "down_proj", "down_proj_bias", e)
                     for e in range(experts.num_experts))
        sb.append(StreamBlock(a, _norm(model, f"model.layers.{i}.input_layernorm"),
                              _norm(model, f"model.layers.{i}.post_attention_layernorm"), None, None, None, router, ins, outs))
    tok = _embedding(model, "model.embed_tokens")
    return ResidualStream("hf_gpt_oss", model, "rmsnorm", "moe_clamped_swiglu", tok, None, sb, _norm(model, "model.norm"),
                          _head(model, "lm_head", tok), cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                          float32_steps=_stock_rmsnorm_note(model))



def _float32_note(norm: nn.Module) -> str:
    """What a stock Hugging Face RMSNorm computes in float32 (``""`` when its forward was replaced)."""
    cls = type(norm)
    if getattr(cls.forward, "__module__", "") != cls.__module__:
        return ""
    return f"RMSNorm in float32 ({cls.__name__} casts to float32 and back)"


def _post_norm_stream(model: nn.Module, cls: str, sites: list[AttentionSite]) -> ResidualStream:
    """OLMo 2 (``x += post(attn(x))``, ``x += post(mlp(x))``) and Gemma 3 (pre- and post-norms)."""
    pre, post, act_key = _HF_POST_NORM[cls]
    cfg = model.config
    act = _GATED.get(getattr(cfg, act_key, None))
    if act is None:
        raise GaugeError(f"find_stream: {cls} with {act_key}={getattr(cfg, act_key, None)!r}; the stream sectors know a "
                         "gated MLP with silu (SwiGLU) or GELU (GeGLU)")
    blocks = list(model.model.layers)
    atts = _check_sites(sites, blocks, "self_attn", cls)
    p = "model.layers"
    sb = [StreamBlock(a, *((_norm(model, f"{p}.{i}.{pre[0]}"), _norm(model, f"{p}.{i}.{pre[1]}")) if pre else (None, None)),
                      _linear(model, f"{p}.{i}.mlp.up_proj"), _linear(model, f"{p}.{i}.mlp.gate_proj"),
                      _linear(model, f"{p}.{i}.mlp.down_proj"), post1=_norm(model, f"{p}.{i}.{post[0]}"),
                      post2=_norm(model, f"{p}.{i}.{post[1]}")) for i, a in enumerate(atts)]
    tok = _embedding(model, "model.embed_tokens")
    return ResidualStream("hf_" + cls.removesuffix("ForCausalLM").lower(), model, "rmsnorm", act, tok, None, sb,
                          _norm(model, "model.norm"), _head(model, "lm_head", tok), cfg.hidden_size, cfg.intermediate_size,
                          cfg.vocab_size, float32_steps=_float32_note(model.model.norm))
