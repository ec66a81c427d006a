"""gaugeopt: gauge-aware training for transformers.

Attention has continuous symmetries (gauges): ``W_Q ← AᵀW_Q, W_K ← A⁻¹W_K`` and
``W_V ← CᵀW_V, W_O ← W_O C⁻ᵀ`` per head leave the function unchanged. gaugeopt finds them in
a model (:func:`find_attention`; :class:`AttentionSpec` describes a new architecture and
:func:`certify` proves the description on it), fixes them while training (GaugeFix-LRM), projects
optimizer updates orthogonally to them, and canonicalises, compares and merges checkpoints;
:func:`flat_directions` measures how many flat directions a small model has and which symmetries
explain them.

The core imports only torch. Lightning callbacks live in :mod:`gaugeopt.callbacks`, Triton
kernels in :mod:`gaugeopt.kernels`.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)))
    >>> len(gaugeopt.find_attention(model)), gaugeopt.gauge_dimension(model, per_symmetry=True)["qk"]
    (2, 256)
"""

from gaugeopt.transforms import invalid_gauge_transform, random_gauge_transform, relative_change
from gaugeopt.tools.canonical import canonical_metrics, canonicalize
from gaugeopt.tools.checkpoint import load_checkpoint, save_checkpoint
from gaugeopt.flat.counting import gauge_dimension
from gaugeopt.flat.meter import FlatReport, flat_directions
from gaugeopt.projection.diagnostics import vertical_fraction, vertical_report
from gaugeopt.tools.equivalence import equivalent, spectral_fingerprint
from gaugeopt.errors import GaugeError
from gaugeopt.fix import FixOptions, GaugeFixer, GaugeFixReport, gauge_fix, qk_drift, vo_drift
from gaugeopt.adapters.apply_lrm import LRMLinear, apply_lrm, lrm_param_groups
from gaugeopt.adapters.apply_lrm import fold_lrm
from gaugeopt.adapters.muon_groups import muon_param_groups
from gaugeopt.models.lrm import LRMExportWarning
from gaugeopt.tools.merging import merge
from gaugeopt.integrations.optim import GaugeOptimizer, GaugeProjected
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.records.rope import RopeSpec
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.find import find_attention, register_adapter
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec, site_from_linears
from gaugeopt.trust.proof import CertificateReport, certify
from gaugeopt.trust.gate import assume_certified
from gaugeopt.trust.static_checks import read_only_hook
from gaugeopt.adapters.stock import accept_patch
from gaugeopt.fix.transport import register_state_rule
from gaugeopt.clip.logits import max_attention_logits
from gaugeopt.clip.qk_clip import QKClipReport, qk_clip

__version__ = "0.1.0"

__all__ = [
    "accept_patch",
    "AttentionSite",
    "AttentionSpec",
    "CertificateReport",
    "FixOptions",
    "FlatReport",
    "QKNormSpec",
    "certify",
    "GaugeError",
    "GaugeFixReport",
    "GaugeFixer",
    "GaugeOptimizer",
    "GaugeProjected",
    "GaugeProjector",
    "QKClipReport",
    "LRMLinear",
    "RopeSpec",
    "apply_lrm",
    "assume_certified",
    "canonical_metrics",
    "canonicalize",
    "equivalent",
    "find_attention",
    "flat_directions",
    "fold_lrm",
    "LRMExportWarning",
    "spectral_fingerprint",
    "gauge_dimension",
    "gauge_fix",
    "invalid_gauge_transform",
    "load_checkpoint",
    "lrm_param_groups",
    "max_attention_logits",
    "merge",
    "muon_param_groups",
    "qk_clip",
    "qk_drift",
    "random_gauge_transform",
    "read_only_hook",
    "register_adapter",
    "register_state_rule",
    "relative_change",
    "save_checkpoint",
    "site_from_linears",
    "vertical_fraction",
    "vertical_report",
    "vo_drift",
]
