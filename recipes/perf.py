"""Peak FLOP/s per accelerator, for model FLOPs utilisation (MFU).

MFU = (training FLOPs per token × tokens per second per device) / (the device's peak FLOP/s),
with FLOPs per token ``6·N + 12·L·h·d·T`` (PaLM appendix B, as nanoGPT; :meth:`GPT.flops_per_token`).
The peak is the vendor's *dense* tensor-core figure (no 2:4 sparsity) for the training dtype:
``bf16-*`` precisions use the bf16 peak, ``16-*`` the fp16 peak.  Float32 training has no entry
(its peak depends on whether TF32 is allowed), and neither has any device not in the table: an
unknown peak means no MFU is logged, never a made-up number.  Add a row to :data:`PEAK_FLOPS` for
another device.

Example::

    >>> from recipes.perf import peak_flops
    >>> peak_flops("NVIDIA A100-SXM4-80GB", "bf16-mixed")
    312000000000000.0
    >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4e12
    True
    >>> peak_flops("cpu", "32-true") is None
    True
"""

from __future__ import annotations

import re

__all__ = ["PEAK_FLOPS", "peak_flops", "precision_dtype", "device_name"]

# (regex on torch.cuda.get_device_name(), label, dense bf16 FLOP/s, dense fp16 FLOP/s); first match wins.
# Sources: NVIDIA/AMD datasheets (tensor-core figures quoted "with sparsity" halved).
PEAK_FLOPS: list[tuple[str, str, float | None, float | None]] = [
    (r"H100.*NVL", "H100 NVL", 835.5e12, 835.5e12),
    (r"H100.*PCIe", "H100 PCIe", 756.5e12, 756.5e12),
    (r"GH200|H100", "H100 SXM", 989.4e12, 989.4e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"H200.*NVL", "H200 NVL", 835.5e12, 835.5e12),
    (r"H200", "H200 SXM", 989.4e12, 989.4e12),
    (r"B200", "B200", 2250e12, 2250e12),
    (r"A100", "A100", 312e12, 312e12),
    (r"L40S", "L40S", 362.05e12, 362.05e12),
    (r"\bL40\b", "L40", 181.05e12, 181.05e12),
    (r"\bL4\b", "L4", 121e12, 121e12),
    (r"\bA10\b", "A10", 125e12, 125e12),  # not the A10G, whose peak NVIDIA does not publish
    (r"V100.*PCIE", "V100 PCIe", None, 112e12),  # Volta has no bf16 tensor cores
    (r"V100", "V100 SXM2", None, 125e12),
    (r"\bT4\b", "T4", None, 65e12),
    (r"MI300X", "MI300X", 1307.4e12, 1307.4e12),
    (r"MI250X", "MI250X", 383e12, 383e12),
]


def precision_dtype(precision: str) -> str | None:
    """``"bf16"`` for bf16 precisions, ``"fp16"`` for fp16 ones, ``None`` otherwise (no MFU)."""
    p = str(precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16") or p == "fp16":
        return "fp16"
    return None


def peak_flops(device: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one ``device`` (a CUDA device name) at ``precision``, or ``None`` if unknown."""
    dtype = precision_dtype(precision)
    if dtype is None:
        return None
    for pattern, _label, bf16, fp16 in PEAK_FLOPS:
        if re.search(pattern, device):
            return bf16 if dtype == "bf16" else fp16
    return None


def device_name(device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, else the device type (``"cpu"``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
