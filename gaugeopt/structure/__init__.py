"""Where a model's attention lives and how its gauge group acts on it.

* :mod:`.site` — :class:`TensorRef`, :class:`Projection`, :class:`AttentionSite`: one record per
  attention layer, with the canonical layouts every gauge computation reads;
* :mod:`.registry` — the adapter registry and :func:`find_attention`;
* :mod:`.spec` — :class:`AttentionSpec`, the declarative adapter;
* :mod:`.linears` — building blocks for adapters (linear-like modules, fused row layouts);
* :mod:`.certificate`, :mod:`.certified` — :func:`certify` and the rule that gauge operations
  use only verified or certified records;
* :mod:`.rope` — rotation planes and the RoPE commutant;
* :mod:`.lrm` — learnable multipliers (:class:`LRMLinear`, :func:`apply_lrm`);
* :mod:`.actions` — finite gauge actions, random group elements, invalid controls;
* :mod:`.bias` — the bias sectors (key-bias shift, value-bias trade): which bias moves, where;
* :mod:`.latent` — multi-head latent attention (DeepSeek-V2/V3): its shared RoPE key and latent spaces;
* :mod:`.stream`, :mod:`.stream_sectors` — the residual stream of a decoder (writers, norms,
  readers) and the symmetries that act across it;
* :mod:`.symmetries` — every known symmetry as a family of finite actions on one model;
* :mod:`.scores`, :mod:`.logits` — what a call adds to ``q·k`` (scale, RoPE angles, masks), and each
  head's maximum attention logit rebuilt from the records (:func:`gaugeopt.max_attention_logits`);
* :mod:`.adapters` — the built-in adapters.
"""

from gaugeopt.structure.registry import find_attention, register_adapter
from gaugeopt.structure.rope import NO_ROPE, RopeSpec
from gaugeopt.structure.site import AttentionSite, Projection, TensorRef
from gaugeopt.structure.spec import AttentionSpec, QKNormSpec, site_from_linears
from gaugeopt.structure.certificate import CertificateReport, certify

__all__ = [
    "AttentionSite", "AttentionSpec", "CertificateReport", "NO_ROPE", "Projection", "QKNormSpec", "RopeSpec", "TensorRef",
    "certify", "find_attention", "register_adapter", "site_from_linears",
]
