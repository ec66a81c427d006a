"""The sectors of the attention gauge group, each described once (:mod:`.registry`, docs/sectors.md).

Importing this package registers the built-in sectors, one module per family, in this order:

* :mod:`.heads` — ``qk``, ``vo``, ``perm``;
* :mod:`.multipliers` — ``lrm_qk``, ``lrm_vo``, ``lrm_internal``;
* :mod:`.norm_gains` — ``qk_gain``;
* :mod:`.biases` — ``key_bias``, ``value_bias``;
* :mod:`.latents` — ``qk_rope``, ``latent_rotation``, ``latent_gain``.

Every list of sectors in gaugeopt — the random transforms' kinds, the certificate's claims, the
projector's sectors, the families of the flat-direction meter, the counts — is read from here.

Example:
    >>> from gaugeopt import sectors
    >>> [s.name for s in sectors.sectors()]  # doctest: +NORMALIZE_WHITESPACE
    ['qk', 'vo', 'perm', 'lrm_qk', 'lrm_vo', 'lrm_internal', 'qk_gain', 'key_bias', 'value_bias', 'qk_rope',
     'latent_rotation', 'latent_gain']
"""

from gaugeopt.sectors import heads, multipliers, norm_gains, biases, latents  # noqa: F401  (registration)
from gaugeopt.sectors.registry import (
    CONTROL_GROUPS,
    Control,
    Family,
    ProjectionRule,
    Sector,
    claimed,
    control,
    controls,
    generation,
    in_proof_order,
    in_transform_order,
    register,
    register_control,
    run,
    sector,
    sectors,
    unregister,
    unregister_control,
)

__all__ = [
    "CONTROL_GROUPS", "Control", "Family", "ProjectionRule", "Sector", "claimed", "control", "controls", "generation",
    "in_proof_order", "in_transform_order", "register", "register_control", "run", "sector", "sectors", "unregister",
    "unregister_control",
]
