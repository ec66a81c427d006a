"""Learnable multipliers: conversion preserves the function, Q/K/V get separate multipliers,
the forward never materialises W, and the paper's parameter groups."""

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt import GaugeError, LRMLinear
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.trust.invariance import randomize_parameters


@pytest.mark.parametrize("name", ["gpt", "gpt_rope_split_half_gqa", "hf_gpt2", "hf_llama", "hf_qwen2"])
def test_conversion_preserves_logits(name):
    case = zoo.build(name)
    ref = case.logits()
    converted = gaugeopt.apply_lrm(case.copy())
    assert any(isinstance(m, LRMLinear) for m in converted.modules())
    assert gaugeopt.relative_change(ref, case.logits(converted)) <= 1e-12


def test_random_multipliers_match_dense_effective_weight():
    """LRMLinear(x) equals x @ (diag(r) W̄ diag(c))ᵀ + r ⊙ b̄, built independently."""
    lin = LRMLinear(6, 7, bias=True, split_sizes=(3, 4)).double()
    randomize_parameters(lin, torch.Generator().manual_seed(0))
    x = torch.randn(5, 6, dtype=torch.float64)
    r = torch.cat([lin.row_mults[0], lin.row_mults[1]])
    c = torch.stack([lin.col_mults[0]] * 3 + [lin.col_mults[1]] * 4)  # (7, 6): row i uses its block's c
    W = r[:, None] * lin.weight * c
    expected = x @ W.T + r * lin.bias
    assert torch.allclose(lin(x), expected, rtol=1e-14, atol=1e-14)
    assert torch.allclose(lin.effective_weight(), W, rtol=1e-15, atol=0)


def test_forward_never_builds_the_dense_matrix():
    """Only (tokens x features)-sized tensors are allocated: no op in the forward writes an
    out x in matrix (views of W̄ itself share its memory and are not counted)."""
    lin = LRMLinear(64, 96)
    x = torch.randn(3, 64)
    shapes = []

    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in ins:  # new memory, not a view
                shapes.append(tuple(out.shape))
            return out

    with Record():
        lin(x)
    assert (96, 64) not in shapes and (64, 96) not in shapes


def test_fused_qkv_gets_separate_multipliers_and_names():
    model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_kv_head=2, n_embd=16)))
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, LRMLinear) and c_attn.split_sizes == (16, 8, 8)
    names = {n for n, _ in model.named_parameters()}
    for k in range(3):
        assert f"transformer.h.0.attn.c_attn.row_mults.{k}" in names
        assert f"transformer.h.0.attn.c_attn.col_mults.{k}" in names
    assert "transformer.h.0.attn.c_attn.row_mults.3" not in names


def test_multiplier_count_matches_paper_for_gpt2_small():
    """Paper 002: GPT-2 124M has ~170K multiplier parameters (Q, K, V separate, no output head)."""
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=64)
    with torch.device("meta"):
        model = gaugeopt.apply_lrm(GPT(cfg))
    n = sum(p.numel() for m in model.modules() if isinstance(m, LRMLinear) for p in (*m.row_mults, *m.col_mults))
    assert n == 12 * ((3 * 768 + 3 * 768) + (768 + 768) + (3072 + 768) + (768 + 3072))  # 165,888
    assert 160_000 < n < 175_000


def test_tied_head_and_mha_are_not_converted():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    gaugeopt.apply_lrm(model)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    mha = zoo.build("torch_mha").model
    gaugeopt.apply_lrm(mha)
    assert type(mha.attn.out_proj) is not LRMLinear and isinstance(mha.head, LRMLinear)


def test_conv1d_conversion_and_double_conversion():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=8))
    w = model.transformer.h[0].attn.c_attn.weight.detach().clone()  # (in=8, out=24)
    gaugeopt.apply_lrm(model)
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.split_sizes == (8, 8, 8) and torch.equal(c_attn.weight, w.t())
    with pytest.raises(GaugeError, match="only once"):
        gaugeopt.apply_lrm(model)


@pytest.mark.parametrize("condition", ["A", "B", "C"])
def test_param_groups_for_the_papers_conditions(condition):
    model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)))
    groups = gaugeopt.lrm_param_groups(model, condition, lr=1e-3)
    by_name = {g["name"]: g for g in groups}
    names_of = {id(p): n for n, p in model.named_parameters()}
    assert all(g["lr"] == 1e-3 for g in groups)
    assert by_name["matrices"]["weight_decay"] == 0.1 and by_name["multipliers"]["weight_decay"] == 2e-3
    every = [id(p) for g in groups for p in g["params"]]
    assert len(every) == len(set(every)) == len({id(p) for p in model.parameters()})
    qk_rows = {f"transformer.h.{i}.attn.c_attn.row_mults.{k}" for i in range(2) for k in (0, 1)}
    if condition == "A":
        assert "qk_multipliers" not in by_name
        assert qk_rows <= {names_of[id(p)] for p in by_name["multipliers"]["params"]}
    else:
        assert {names_of[id(p)] for p in by_name["qk_multipliers"]["params"]} == qk_rows
        assert by_name["qk_multipliers"]["weight_decay"] == 0.0
        # V row multipliers and all column multipliers keep the multiplier decay
        assert "transformer.h.0.attn.c_attn.row_mults.2" in {names_of[id(p)] for p in by_name["multipliers"]["params"]}
    assert all(p.dim() >= 2 for p in by_name["matrices"]["params"])
    # AdamW accepts the groups as they are
    torch.optim.AdamW(groups)


def test_param_groups_errors():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(GaugeError, match="apply_lrm"):
        gaugeopt.lrm_param_groups(model, "A")
    gaugeopt.apply_lrm(model)
    with pytest.raises(GaugeError, match="condition"):
        gaugeopt.lrm_param_groups(model, "D")
