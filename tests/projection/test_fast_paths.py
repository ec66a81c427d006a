"""Fast paths that would read a converted layer's raw weight and skip its learnable multipliers.

``nn.TransformerEncoderLayer`` calls a fused kernel in eval mode without gradients, passing
``linear1.weight`` and ``linear2.weight`` directly (and ``nn.TransformerEncoder`` its nested-tensor
path): after ``apply_lrm`` those are ``W̄``, not ``diag(r)·W̄·diag(c)``. apply_lrm switches those
paths off for converted layers; eval and train outputs must then agree (dropout 0, float64). The
control re-enables the fast path on the converted layers and shows it would be taken here, and
wrong.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.trust.invariance import randomize_parameters

D, HEADS = 16, 4


def _encoder(seed: int = 0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).double()
    gaugeopt.apply_lrm(enc)
    randomize_parameters(enc, torch.Generator().manual_seed(seed))  # multipliers away from 1
    return enc


def _outputs(enc, x, mask=None):
    out = []
    for train in (True, False):
        enc.train(train)
        with torch.no_grad():
            y = enc(x, src_key_padding_mask=mask)
        out.append(y if mask is None else y[~mask])
    return out


def test_lrm_transformer_encoder_eval_equals_train():
    enc = _encoder()
    assert all(type(layer.linear1) is gaugeopt.LRMLinear for layer in enc.layers)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 3:] = True
    train, evaluation = _outputs(enc, x)
    assert gaugeopt.relative_change(train, evaluation) <= 1e-12
    train, evaluation = _outputs(enc, x, mask)  # the nested-tensor path of the encoder
    assert gaugeopt.relative_change(train, evaluation) <= 1e-12

    for layer in enc.layers:  # control: the fast path, had apply_lrm left it on, is taken here and wrong
        layer.activation_relu_or_gelu = 1
    enc.use_nested_tensor = True
    train, evaluation = _outputs(enc, x)
    assert gaugeopt.relative_change(train, evaluation) >= 1e-3
    train, evaluation = _outputs(enc, x, mask)
    assert gaugeopt.relative_change(train, evaluation) >= 1e-3


def test_lrm_after_adamw_steps_keeps_eval_exact():
    """The issue's setting: a few AdamW steps move the multipliers, then evaluation."""
    enc = _encoder(seed=2)
    x = torch.randn(4, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-2)
    enc.train()
    for _ in range(5):
        enc(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    train, evaluation = _outputs(enc, x)
    assert gaugeopt.relative_change(train, evaluation) <= 1e-12


def test_model_compiled_before_conversion_recompiles():
    """A compiled graph captured before apply_lrm is not reused: the replaced modules fail its guards."""
    from gaugeopt.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).double()
    compiled = torch.compile(model, backend="eager")
    x = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        compiled(x)
    gaugeopt.apply_lrm(compiled)
    randomize_parameters(model, torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert gaugeopt.relative_change(model(x)[0], compiled(x)[0]) == 0.0
