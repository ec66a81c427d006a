"""How many independent parameter-space directions are symmetries: counts per model and per sector.

Three conventions (docs/gauge_group.md, docs/model_tools.md), from a model *or* from a config
without allocating weights. They count *symmetry directions* — the dimension of a group's orbit
through generic weights — and only ``"complete"`` is meant to equal the number of flat directions
a model has (the nullity of its logits' Jacobian, measured by :func:`gaugeopt.flat_directions`):

``convention="wang"`` (paper 000): the continuous head-wise attention symmetries,
    per layer and KV group ``dim(Q/K) + d_v²`` with ``dim(Q/K) = d_k²`` without RoPE and
    ``r + (d_k − r)²`` with ``r`` rotated coordinates — ``h(d_k + d_v²)`` per layer for full
    RoPE. GPT-2 small: ``12·12·(64² + 64²) = 1,179,648``. A lower bound: the model has more.

``convention="van_nierop"`` (paper 003, Table 1): ``L·h·(d_k² + d_v²)`` plus the residual-stream
    rotations ``(d−1)(d−2)/2`` (it ignores RoPE). GPT-2 small 1,473,409; GPT-2 XL 11,108,001
    (≈ 11.1M); LLaMA-65B 201,314,305 (≈ 201M). Not a count of symmetries of these models as
    parameterised: the rotations are symmetries only with an untied head, and then paper 003's
    formula omits the other sectors (docs/errata.md).

**Multi-head latent attention** (DeepSeek-V2/V3, docs/mla.md). ``"wang"``: per layer ``h·n²`` (``qk``,
the part without RoPE, ``n = qk_nope_head_dim``) ``+ r`` (``qk_rope``: the RoPE commutant of the one
key all heads share) ``+ h·d_v²`` (``vo``); DeepSeek-V3 (61 layers, 128 heads, ``n = d_v = 128``,
``r = 64``): 255,856,448. ``"van_nierop"``: its formula with the whole head width ``n + r``.
``"complete"`` adds the latent sectors, ``latent_rotation`` ``Σ L(L−1)/2`` and ``latent_gain`` ``Σ L``
over the query and key–value latents, and the stream of a dense model (routed layers are refused).

``convention="complete"``: every exact continuous symmetry gaugeopt knows, for the models whose
    residual stream it understands (:func:`gaugeopt.flat.stream.find_stream`: gaugeopt's GPT,
    Hugging Face GPT-2, the Llama family and the QK-norm families Qwen3, OLMo 2, Gemma 3; configs of
    those). Per layer: ``qk`` and ``vo`` as
    ``"wang"``; the bias sectors ``key_bias`` ``h_kv(d_k − r)`` and ``value_bias`` ``h_kv·d_v``
    (:mod:`gaugeopt.records.bias_sector`); ``norm_gain`` ``d`` per norm; with LayerNorm ``norm_bias``
    ``d`` per norm with a bias, ``norm_meanfree`` the rows of every reader of the norm (when the norm
    has no bias or the reader has one: ``(h + h_kv)·d_k + h_kv·d_v`` after ``norm1``, ``d_ff`` per MLP
    input after ``norm2``) and ``residual_ones`` ``h·d_v + [b_O] + d_ff + [b_down]``; ``mlp_scale``
    ``d_ff`` for SwiGLU and ReLU; gpt-oss: ``router_shift`` ``d + 1`` (its top-k router) and
    ``expert_up_scale`` one per expert unit ``E·d_ff`` (instead of ``mlp_scale``; exact while its
    clamp is inactive, :mod:`gaugeopt.flat.stream_sectors`), and its attention sinks remove both
    bias sectors. Once: with LayerNorm ``residual_ones`` ``T`` learned positions
    (+ ``V`` with an untied head); ``embedding_shift`` ``d − [LayerNorm]`` (untied, learned
    positions) or ``1`` (tied, LayerNorm without a final bias); with an untied head the final norm's
    ``norm_gain`` ``d``, ``norm_bias`` ``d``, ``norm_meanfree`` ``V`` (no final bias or a head bias),
    and ``residual_rotation`` ``d(d−1)/2`` (RMSNorm) or ``(d−1)(d−2)/2`` (LayerNorm). Blocks that
    normalise their outputs (OLMo 2 without pre-norms, Gemma 3 with both) have no gain sector for those
    post-norms and no rotations; a QK-norm layer counts its gain gauge instead of ``qk`` (below). The
    derivations are in :mod:`gaugeopt.flat.stream_sectors` and docs/qk_norm.md. It equals the
    measured nullity on generic weights, with the logits as the output and inputs that use every token
    and position (``tests/tools/test_flat.py``). GPT-2 small: 1,346,584 — of paper 003's 293,761 rotations
    none is a symmetry of the tied model; Qwen3-0.6B: 3,815,168.

    *Logits, not log-probabilities.* The cross-entropy's Gauss–Newton (Fisher) metric has the null
    space of the log-probabilities' Jacobian, which also contains a change common to every logit of a
    position: ``d`` more directions with an untied head (``W_head += 1vᵀ``) or learned positions
    (``wte += 1vᵀ``, ``wpe −= 1vᵀ``), none for a tied head under RoPE (docs/errata.md, row 6). The
    complete count does not include them.

With GQA every count uses the KV groups (``h_kv``), which is where the symmetry lives. A model
with learnable multipliers has one more family, the internal ``r·W̄·c`` rescalings of every
LRM layer (``rows + in`` per multiplier block), reported as ``"lrm_internal"`` and included in
the total.

**QK-norm** (docs/qk_norm.md). A layer that normalises queries and keys keeps none of ``GL(d_k)``
on ``W_Q``/``W_K``; its Q/K gauge is the gain gauge, one factor per slot — ``n_p = r/2 + (d_k − r)``
slots when the norm acts before RoPE (``"wang"``), ``d_k`` when RoPE is ignored (``"van_nierop"``)
or acts first — per layer for a gain vector shared by all heads, per KV group for per-head gains
(``"qk_gain"``). A LayerNorm adds directions the function never sees (``"qk_layernorm"``): the mean
direction of every query and key head's rows, ``(h + h_kv)·(d_model [+ 1 with biases])``, and without
RoPE the key bias (``d_k``), one query-bias shift and one centred rotation; under partial RoPE the
key bias on the ``d_k − r`` channels RoPE leaves alone (Phi). With ``eps = 0`` every
head (per-head norm) or each side (full-width norm) gains a positive scale (``"qk_head_scale"``).
Qwen3-0.6B: ``"wang"`` ``28·(64 + 8·128²) = 3,671,808``; ``"van_nierop"`` ``28·(128 + 8·128²) +
1023·1022/2 = 4,196,353`` — whose rotations are not symmetries of that tied model; ``"complete"``
``28·(64 + 8·128² + 2·1024 + 3072) = 3,815,168``.

Example:
    >>> from gaugeopt import gauge_dimension
    >>> gauge_dimension({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768})
    1179648
    >>> gauge_dimension({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}, convention="van_nierop")
    1473409
    >>> gauge_dimension({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
    ...                  "n_positions": 1024}, convention="complete")
    1346584
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.bias_sector import sector_dims
from gaugeopt.records.latent import latent_dims
from gaugeopt.records.rope import NO_ROPE, RopeSpec
from gaugeopt import sectors
from gaugeopt.sectors.norm_gains import qk_norm_counts
from gaugeopt.flat.stream import StreamShape

__all__ = ["LayerShape", "NormShape", "LatentShape", "gauge_dimension", "layer_shapes", "stream_shape", "CONVENTIONS"]

CONVENTIONS = ("wang", "van_nierop", "complete")


@dataclass(frozen=True)
class NormShape:
    """What a count needs of a layer's QK-norm (:class:`~gaugeopt.records.site.QKNorm`)."""

    kind: str = "rms"
    per_head: bool = False
    scope: str = "head"
    before_rope: bool = True
    eps: float = 1e-6
    bias: bool = False


@dataclass(frozen=True)
class LatentShape:
    """What a count needs of a multi-head latent attention layer (docs/mla.md): the RoPE width ``r`` of its
    shared key and the widths of its query latent (``None``: a plain query projection) and key–value latent."""

    r: int
    L_q: int | None
    L_kv: int

    def dims(self) -> dict[str, int]:
        """``qk_rope``, ``latent_rotation``, ``latent_gain`` (:func:`gaugeopt.records.latent.latent_dims`)."""
        return latent_dims(self.L_q, self.L_kv, self.r)


@dataclass(frozen=True)
class LayerShape:
    """The head structure of one attention layer, all a count needs (``qk_bias``: the query projection
    has a bias; ``k_bias``, ``v_bias``, ``o_bias``: the others; ``qk_norm``: the layer normalises
    queries and keys; ``sinks``: attention sinks, which remove the bias sectors; ``latent``: multi-head
    latent attention, whose ``d_k``/``rope`` are then those of its part without RoPE)."""

    h: int
    h_kv: int
    d_k: int
    d_v: int
    d_model: int
    rope: RopeSpec = NO_ROPE
    qk_norm: NormShape | None = None
    qk_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    qk_orthogonal: bool = False  # a weight-free norm per head: only the orthogonal part of the Q/K gauge
    latent: LatentShape | None = None

    def qk_dim(self, ignore_rope: bool = False) -> int:
        """The Q/K gauge of one KV group (``ignore_rope``: as paper 003 counts it)."""
        rope = NO_ROPE if ignore_rope else self.rope
        return rope.orthogonal_gauge_dim(self.d_k) if self.qk_orthogonal else rope.qk_gauge_dim(self.d_k)

    def bias_sectors(self) -> dict[str, int]:
        """Dimensions of the layer's bias sectors (:func:`gaugeopt.records.bias_sector.sector_dims`)."""
        return sector_dims(h_kv=self.h_kv, d_k=self.d_k, d_v=self.d_v, rotary_dim=self.rope.rotary_dim,
                           k_bias=self.k_bias, v_bias=self.v_bias, o_bias=self.o_bias, qk_norm=self.qk_norm is not None,
                           sinks=self.sinks)


def _get(cfg: Any, *names: str, default=None):
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _rope_from_hf(cfg: Any, d_k: int) -> RopeSpec:
    params = _get(cfg, "rope_parameters", "rope_scaling") or {}
    factor = params.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", default=1.0)) or 1.0
    r = int(d_k * factor)
    r -= r % 2
    return RopeSpec("split_half", r)


_DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def _deepseek_layer(cfg: Any, model_type: str) -> LayerShape:
    """One DeepSeek-V2/V3 layer (multi-head latent attention) from its config: the part without RoPE as the
    record sees it (``d_k = qk_nope_head_dim``, no RoPE, one key per head) and its :class:`LatentShape`."""
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "kv_lora_rank", "qk_rope_head_dim",
                           "qk_nope_head_dim", "v_head_dim") if _get(cfg, k) is None]
    if missing:
        raise GaugeError(f"gauge_dimension: a {model_type} config without {', '.join(missing)}")
    h, n, dv = _get(cfg, "num_attention_heads"), _get(cfg, "qk_nope_head_dim"), _get(cfg, "v_head_dim")
    r = _get(cfg, "qk_rope_head_dim")
    h_kv = _get(cfg, "num_key_value_heads", default=h)
    if h_kv != h:
        raise GaugeError(f"gauge_dimension: a {model_type} config with num_key_value_heads={h_kv} != num_attention_heads={h} "
                         "(Hugging Face's DeepSeek attention then fails; gaugeopt refuses such a model too)")
    o_bias = bool(_get(cfg, "attention_bias", default=False))
    latent = LatentShape(r, _get(cfg, "q_lora_rank"), _get(cfg, "kv_lora_rank"))  # either RoPE layout: r/2 planes
    return LayerShape(h, h, n, dv, _get(cfg, "hidden_size"), NO_ROPE, None, False, False, False, o_bias, latent=latent)


# model_type -> (QK-norm scope and per-head gains), for the Hugging Face QK-norm families
_HF_QK_NORM = {"qwen3": ("head", False), "olmo2": ("full", True), "gemma3_text": ("head", False)}


def _site_shape(s) -> LayerShape:
    n = s.qk_norm
    norm = None if n is None else NormShape(n.kind, n.per_head, n.scope, n.before_rope, n.eps, n.q_bias is not None)
    lat = s.latent
    latent = None if lat is None else LatentShape(
        lat.r, None if lat.q_latent is None else lat.q_latent.width, lat.kv_latent.width)
    return LayerShape(s.h, s.h_kv, s.d_k, s.d_v, s.d_model, s.rope, norm, s.q.bias is not None, s.k.bias is not None,
                      s.v.bias is not None, s.o.bias is not None, s.sinks is not None, bool(s.qk_orthogonal), latent)


def _gemma3_text(cfg: Any) -> Any:
    """The language model's config inside a multimodal Gemma 3 config (its ``text_config``)."""
    text = _get(cfg, "text_config")
    if text is None:
        raise GaugeError("gauge_dimension: a gemma3 config without text_config; pass the text model's config")
    return text if _get(text, "model_type") else {**dict(text), "model_type": "gemma3_text"}


def layer_shapes(model_or_config: Any) -> list[LayerShape]:
    """Per-layer head structure of a model (via :func:`gaugeopt.find_attention`) or a config.

    Configs: :class:`gaugeopt.models.GPTConfig`, a Hugging Face ``PretrainedConfig`` or its
    ``config.json`` as a dict, for ``model_type`` gpt2, llama, mistral, qwen2, the QK-norm
    families qwen3, olmo2, gemma3_text (``gemma3``: its ``text_config``), and deepseek_v2,
    deepseek_v3 (multi-head latent attention).
    """
    if isinstance(model_or_config, nn.Module):
        from gaugeopt.trust.gate import trusted_sites

        return [_site_shape(s) for s in trusted_sites(model_or_config, "gauge_dimension")]
    cfg = model_or_config
    from gaugeopt.models.gpt import GPTConfig

    if isinstance(cfg, GPTConfig):
        rope = NO_ROPE if cfg.rope == "none" else RopeSpec(cfg.rope, cfg.rotary_dim)
        norm = NormShape("rms", False, "head", True, 1e-6) if cfg.qk_norm else None  # gaugeopt.models.gpt.RMSNorm
        b = cfg.bias
        shape = LayerShape(cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, cfg.n_embd, rope, norm, b, b, b, b)
        return [shape] * cfg.n_layer
    model_type = _get(cfg, "model_type")
    if model_type == "gemma3":
        return layer_shapes(_gemma3_text(cfg))
    if model_type in _DEEPSEEK:
        return [_deepseek_layer(cfg, model_type)] * _get(cfg, "num_hidden_layers")
    if model_type == "gpt2":
        L, h, d = _get(cfg, "n_layer", "num_hidden_layers"), _get(cfg, "n_head", "num_attention_heads"), _get(cfg, "n_embd", "hidden_size")
        return [LayerShape(h, h, d // h, d // h, d, qk_bias=True, k_bias=True, v_bias=True, o_bias=True)] * L
    if model_type in ("llama", "mistral", "qwen2") or model_type in _HF_QK_NORM:
        L = _get(cfg, "num_hidden_layers")
        h = _get(cfg, "num_attention_heads")
        h_kv = _get(cfg, "num_key_value_heads", default=h)
        d = _get(cfg, "hidden_size")
        d_k = _get(cfg, "head_dim", default=d // h)
        bias = bool(_get(cfg, "attention_bias", default=model_type == "qwen2"))
        norm = None
        if model_type in _HF_QK_NORM:
            scope, per_head = _HF_QK_NORM[model_type]
            norm = NormShape("rms", per_head, scope, True, float(_get(cfg, "rms_norm_eps", default=1e-6)))
        o_bias = bool(_get(cfg, "attention_bias", default=False))  # Qwen2 biases Q, K, V but not O
        return [LayerShape(h, h_kv, d_k, d_k, d, _rope_from_hf(cfg, d_k), norm, bias, bias, bias, o_bias)] * L
    if model_type == "gpt_oss":  # attention sinks on every layer, biases on all four projections
        h = _get(cfg, "num_attention_heads")
        d = _get(cfg, "hidden_size")
        d_k = _get(cfg, "head_dim", default=d // h)
        b = bool(_get(cfg, "attention_bias", default=True))
        shape = LayerShape(h, _get(cfg, "num_key_value_heads", default=h), d_k, d_k, d, RopeSpec("split_half", d_k),
                           None, b, b, b, b, sinks=True)
        return [shape] * _get(cfg, "num_hidden_layers")
    raise GaugeError(
        f"gauge_dimension: cannot read a config of model_type={model_type!r} ({type(cfg).__qualname__}); "
        "pass a model, a gaugeopt GPTConfig, or a gpt2/llama/mistral/qwen2/qwen3/olmo2/gemma3/gpt_oss/deepseek_v2/"
        "deepseek_v3 config (object or config.json dict)"
    )


def _lrm_internal(model: Any) -> int:
    if not isinstance(model, nn.Module):
        return 0
    from gaugeopt.models.lrm import LRMLinear

    return sum(m.internal_gauge_dim for m in model.modules() if isinstance(m, LRMLinear))


def stream_shape(model_or_config: Any) -> StreamShape:
    """The :class:`~gaugeopt.flat.stream.StreamShape` of a model (via
    :func:`~gaugeopt.flat.stream.find_stream`) or a config: :class:`gaugeopt.models.GPTConfig`, or a
    ``gpt2``/``llama``/``mistral``/``qwen2``/``qwen3``/``olmo2``/``gemma3(_text)`` Hugging Face config
    (object or ``config.json`` dict).

    Raises:
        GaugeError: a model or config whose residual stream gaugeopt does not describe.
    """
    if isinstance(model_or_config, nn.Module):
        from gaugeopt.flat.stream import find_stream

        return find_stream(model_or_config).shape()
    cfg = model_or_config
    from gaugeopt.models.gpt import GPTConfig

    if isinstance(cfg, GPTConfig):
        return StreamShape(cfg.n_layer, cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size, cfg.block_size if cfg.rope == "none" else 0,
                           cfg.norm, cfg.mlp, cfg.tie_weights, cfg.bias and cfg.norm == "layernorm", cfg.bias, cfg.bias)
    model_type = _get(cfg, "model_type")
    if model_type == "gpt2":
        d = _get(cfg, "n_embd", "hidden_size")
        fn = _get(cfg, "activation_function", default="gelu_new")
        act = {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}.get(fn)
        missing = [k for k in ("vocab_size", "n_positions") if _get(cfg, k) is None]
        if act is None or missing:
            raise GaugeError("gauge_dimension(convention='complete'): a gpt2 config needs "
                             + (f"{' and '.join(missing)}" if missing else f"a GELU or ReLU activation, not {fn!r}"))
        return StreamShape(_get(cfg, "n_layer", "num_hidden_layers"), d, _get(cfg, "n_inner") or 4 * d, _get(cfg, "vocab_size"),
                           _get(cfg, "n_positions"), "layernorm", act, bool(_get(cfg, "tie_word_embeddings", default=True)),
                           True, True, True)
    if model_type == "gemma3":
        return stream_shape(_gemma3_text(cfg))
    if model_type in _STREAM_LAYOUTS:
        act_key, default_act, pre, post, tied = _STREAM_LAYOUTS[model_type]
        act = _get(cfg, act_key, default=default_act)
        missing = [k for k in ("vocab_size", "intermediate_size") if _get(cfg, k) is None]
        if act not in _GATED or missing:
            raise GaugeError(f"gauge_dimension(convention='complete'): a {model_type} config needs "
                             + (f"{' and '.join(missing)}" if missing else
                                f"{act_key} in {sorted(_GATED)} (a gated MLP), not {act!r}"))
        mlp_bias = bool(_get(cfg, "mlp_bias", default=False))
        return StreamShape(_get(cfg, "num_hidden_layers"), _get(cfg, "hidden_size"), _get(cfg, "intermediate_size"),
                           _get(cfg, "vocab_size"), 0, "rmsnorm", _GATED[act],
                           bool(_get(cfg, "tie_word_embeddings", default=tied)), False, mlp_bias, mlp_bias,
                           pre_norms=pre, post_norms=post)
    if model_type == "gpt_oss":
        d, ff, E = _get(cfg, "hidden_size"), _get(cfg, "intermediate_size"), _get(cfg, "num_local_experts")
        if None in (d, ff, E, _get(cfg, "vocab_size")):
            raise GaugeError("gauge_dimension(convention='complete'): a gpt_oss config needs hidden_size, intermediate_size, "
                             "num_local_experts and vocab_size")
        return StreamShape(_get(cfg, "num_hidden_layers"), d, ff, _get(cfg, "vocab_size"), 0, "rmsnorm",
                           "moe_clamped_swiglu", bool(_get(cfg, "tie_word_embeddings", default=False)), False, True, True,
                           router_shift=d + 1, expert_units=E * ff)
    if model_type in _DEEPSEEK:
        L = _get(cfg, "num_hidden_layers")
        dense = _get(cfg, "first_k_dense_replace", default=0)
        if dense < L:
            raise GaugeError(
                f"gauge_dimension(convention='complete'): a {model_type} config routes layers {dense}..{L - 1} to experts "
                "(first_k_dense_replace < num_hidden_layers); gaugeopt derives the stream sectors of dense SwiGLU layers "
                "only. convention='wang' counts the attention gauges (multi-head latent attention included)"
            )
        act = _get(cfg, "hidden_act", default="silu")
        missing = [k for k in ("vocab_size", "intermediate_size") if _get(cfg, k) is None]
        if act != "silu" or missing:
            raise GaugeError(f"gauge_dimension(convention='complete'): a {model_type} config needs "
                             + (f"{' and '.join(missing)}" if missing else f"hidden_act='silu' (SwiGLU), not {act!r}"))
        return StreamShape(L, _get(cfg, "hidden_size"), _get(cfg, "intermediate_size"), _get(cfg, "vocab_size"), 0,
                           "rmsnorm", "swiglu", bool(_get(cfg, "tie_word_embeddings", default=False)), False, False, False)
    raise GaugeError(
        f"gauge_dimension(convention='complete'): no residual-stream description for model_type={model_type!r} "
        f"({type(cfg).__qualname__}); the complete count covers gaugeopt's GPT and "
        f"gpt2/{'/'.join(_STREAM_LAYOUTS)}/gpt_oss/{'/'.join(_DEEPSEEK)} (models or configs); 'wang' counts the "
        "attention gauges of any model"
    )


# model_type -> (activation key, its default, pre-norms, post-norms, tied by default): the block layouts of
# gaugeopt.flat.stream (Llama's pre-norm blocks; OLMo 2's post-norms only; Gemma 3's both)
_STREAM_LAYOUTS = {
    "llama": ("hidden_act", "silu", True, False, False),
    "mistral": ("hidden_act", "silu", True, False, False),
    "qwen2": ("hidden_act", "silu", True, False, False),
    "qwen3": ("hidden_act", "silu", True, False, False),
    "olmo2": ("hidden_act", "silu", False, True, False),
    "gemma3_text": ("hidden_activation", "gelu_pytorch_tanh", True, True, True),
}
_GATED = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu": "geglu"}


def _complete_counts(shapes: list[LayerShape], st: StreamShape) -> dict[str, int]:
    """``convention="complete"`` without ``lrm_internal`` (module docstring)."""
    counts: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        if n:
            counts[key] = counts.get(key, 0) + n

    d, ln = st.d_model, st.norm == "layernorm"
    mlp_inputs = 2 if st.activation in ("swiglu", "geglu") else 1
    counted = [sec for sec in sectors.sectors() if sec.count is not None]
    for s in shapes:
        if s.latent is not None and ln:
            raise GaugeError("gauge_dimension: multi-head latent attention in a LayerNorm stream has no derived count")
        for sec in counted:  # the attention sectors: each registered sector counts itself (Sector.count)
            for key, n in sec.count(s).items():
                add(key, n)
        add("norm_gain", 2 * d if st.pre_norms else 0)  # a pre-norm's gain against its readers; post-norms: none
        if ln:
            add("norm_bias", 2 * d if st.norm_bias else 0)
            readers = [(s.h * s.d_k, s.qk_bias), (s.h_kv * s.d_k, s.k_bias), (s.h_kv * s.d_v, s.v_bias)]
            readers += [(st.d_ff, st.mlp_in_bias)] * mlp_inputs
            add("norm_meanfree", sum(rows for rows, biased in readers if biased or not st.norm_bias))
            add("residual_ones", s.h * s.d_v + s.o_bias + st.d_ff + st.mlp_out_bias)
        if st.activation in ("swiglu", "geglu", "relu"):
            add("mlp_scale", st.d_ff)
        add("router_shift", st.router_shift)
        add("expert_up_scale", st.expert_units)
    if ln:
        add("residual_ones", st.positions + (0 if st.tied else st.vocab))
    if st.positions:
        if not st.tied:
            add("embedding_shift", d - ln)  # with LayerNorm c ∝ 1 is already a residual_ones direction
        elif ln and not st.norm_bias:
            add("embedding_shift", 1)
    if not st.tied:  # the final norm and its reader, the head
        add("norm_gain", d)
        if ln:
            add("norm_bias", d if st.norm_bias else 0)
            add("norm_meanfree", st.vocab if (st.head_bias or not st.norm_bias) else 0)
        if not st.post_norms:  # a post-norm's output γ ⊙ ν(y) does not rotate (stream_sectors)
            add("residual_rotation", (d - 1) * (d - 2) // 2 if ln else d * (d - 1) // 2)
    return counts


def gauge_dimension(
    model_or_config: Any, convention: str = "wang", *, per_symmetry: bool = False
) -> int | dict[str, int]:
    """Count the symmetry dimensions of a model or config.

    Args:
        model_or_config: an ``nn.Module`` or a config (see :func:`layer_shapes`; ``"complete"`` also
            :func:`stream_shape`).
        convention: ``"wang"`` (paper 000, RoPE-reduced), ``"van_nierop"`` (paper 003 Table 1) or
            ``"complete"`` (every exact symmetry gaugeopt knows; the measured number of flat
            directions on generic weights).
        per_symmetry: return ``{"qk": ..., "vo": ..., ...}`` per sector instead of the total; QK-norm
            layers count under ``"qk_gain"`` (and ``"qk_layernorm"``, ``"qk_head_scale"``) instead of
            ``"qk"`` (module docstring).

    Raises:
        GaugeError: an unknown convention, a config it cannot read, or ``"complete"`` for a model
            whose residual stream it does not describe.
    """
    if convention not in CONVENTIONS:
        raise GaugeError(f"gauge_dimension: convention={convention!r} must be one of {CONVENTIONS}")
    shapes = layer_shapes(model_or_config)
    lrm = _lrm_internal(model_or_config)
    if convention == "complete":
        counts = _complete_counts(shapes, stream_shape(model_or_config))
        if lrm:
            counts["lrm_internal"] = lrm
        return counts if per_symmetry else sum(counts.values())
    plain = [s for s in shapes if s.qk_norm is None]
    counts = {}
    if plain or len(plain) == len(shapes):
        if convention == "wang":
            counts["qk"] = sum(s.h_kv * s.qk_dim() for s in plain)
        else:  # paper 003's formula with the whole query/key head width (latent attention: no-RoPE + RoPE widths)
            counts["qk"] = sum(s.h_kv * (s.qk_dim(ignore_rope=True) if s.latent is None else (s.d_k + s.latent.r) ** 2)
                               for s in plain)
    if convention == "wang" and any(s.latent is not None for s in shapes):
        counts["qk_rope"] = sum(s.latent.dims()["qk_rope"] for s in shapes if s.latent is not None)
    for s in shapes:
        if s.qk_norm is not None:
            for key, n in qk_norm_counts(s, ignore_rope=convention == "van_nierop").items():
                counts[key] = counts.get(key, 0) + n
    counts["vo"] = sum(s.h_kv * s.d_v**2 for s in shapes)
    if convention == "van_nierop":
        d = shapes[0].d_model
        counts["residual_rotation"] = (d - 1) * (d - 2) // 2
    if lrm:
        counts["lrm_internal"] = lrm
    return counts if per_symmetry else sum(counts.values())
