"""``gaugeopt.fold_lrm``: every LRM layer replaced by the plain layer it computes, for export.

In float64 the folded model's logits equal the LRM model's to 1e-12 on gaugeopt's GPT (fused
``c_attn``: one ``r``, ``c`` per Q/K/V block), GQA, Hugging Face GPT-2 (``Conv1D``, stored
``(in, out)``) and Llama; its state dict has the names and layouts of the model before
``apply_lrm``; a Hugging Face model saved from a folded copy loads in stock ``from_pretrained`` as
the same function. The control is what happens today without folding: a stock load of the LRM
checkpoint reads ``W̄`` as the weight and silently computes another function.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear, fold_lrm

CASES = ["gpt", "gpt_rope_split_half_gqa", "hf_gpt2", "hf_llama"]


def _plain_state(name: str) -> dict[str, tuple]:
    """Names and shapes of the model's state dict before ``apply_lrm``."""
    return {k: tuple(v.shape) for k, v in zoo.build(name, 0).model.state_dict().items()}


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_to_1e_12_and_the_layout_of_the_plain_model(name):
    case = zoo.build(name, 3, lrm=True)  # multipliers exp(N(0, 0.3²)): far from 1
    folded = fold_lrm(case.copy())
    assert not any(isinstance(m, LRMLinear) for m in folded.modules())
    assert gaugeopt.relative_change(case.logits(), case.logits(folded)) <= 1e-12
    assert {k: tuple(v.shape) for k, v in folded.state_dict().items()} == _plain_state(name)
    if name == "hf_gpt2":
        assert type(folded.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    else:  # nn.Linear layouts: the model tools see one computation (GPT-2's MLP Conv1D stores (in, out))
        assert gaugeopt.equivalent(case.model, folded, 1e-10)
    # control: the base weights alone (what a loader that knows no multipliers reads) are another function
    # W̄ is stored (out, in); a Conv1D wants (in, out): transposed, as an exporter would
    bare = zoo.build(name, 0).model
    bare.load_state_dict({k: (v.t() if _is_conv1d_weight(bare, k) else v)
                          for k, v in case.model.state_dict().items() if "_mults" not in k})
    assert gaugeopt.relative_change(case.logits(), case.logits(bare)) > 1e-2


def _is_conv1d_weight(model: nn.Module, key: str) -> bool:
    owner = model.get_submodule(key.rpartition(".")[0])
    return type(owner).__name__ == "Conv1D" and key.endswith("weight")


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_the_saved_folded_copy_loads_in_stock_transformers_to_the_same_logits(name, tmp_path):
    case = zoo.build(name, 4, lrm=True)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    fold_lrm(copy.deepcopy(case.model)).save_pretrained(tmp_path / "folded")
    assert all(torch.equal(v, case.model.state_dict()[k]) for k, v in before.items())  # the training model as it was
    stock = type(case.model).from_pretrained(tmp_path / "folded", dtype=torch.float64).eval()
    assert not any(isinstance(m, LRMLinear) for m in stock.modules())
    assert gaugeopt.relative_change(case.logits(), case.logits(stock)) <= 1e-12
    # control: save_pretrained of the LRM model itself. Llama's checkpoint loads silently as another function
    # (W̄ read as the weight, r and c dropped); GPT-2's W̄ has the transposed shape of a Conv1D weight and fails.
    case.model.save_pretrained(tmp_path / "unfolded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "hf_gpt2":
            with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
                type(case.model).from_pretrained(tmp_path / "unfolded", dtype=torch.float64)
            return
        naive = type(case.model).from_pretrained(tmp_path / "unfolded", dtype=torch.float64).eval()
    assert gaugeopt.relative_change(case.logits(), case.logits(naive)) > 1e-2


def test_float32_fold_is_formed_in_float64():
    layer = LRMLinear(8, 6, split_sizes=(2, 4))
    with torch.no_grad():
        for p in (*layer.row_mults, *layer.col_mults):
            p.uniform_(0.5, 2.0)
    plain = layer.folded()
    exact = torch.cat([r.double()[:, None] * w.double() * c.double()[None, :] for w, r, c in
                       zip(layer.weight.split((2, 4)), layer.row_mults, layer.col_mults)])
    assert type(plain) is nn.Linear and plain.weight.dtype == torch.float32
    assert torch.equal(plain.weight, exact.float())  # one rounding of the float64 product
    assert torch.equal(plain.bias, (layer.bias.double() * layer.row_multiplier().double()).float())


def test_hooks_move_shared_layers_stay_shared_and_frozen_stays_frozen():
    case = zoo.build("gpt", 5, lrm=True)
    model = case.copy()
    attn = model.transformer.h[0].attn
    attn.c_attn.weight.requires_grad_(False)
    model.alias = attn.c_attn  # the same layer at a second path
    seen = []
    handle = attn.c_attn.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    fold_lrm(model)
    assert model.alias is model.transformer.h[0].attn.c_attn and type(model.alias) is nn.Linear
    assert not model.alias.weight.requires_grad and model.alias.bias.requires_grad
    case.logits(model)
    assert seen == ["Linear"]
    handle.remove()
    case.logits(model)
    assert seen == ["Linear"]


def test_a_model_without_multipliers_is_unchanged_and_folding_twice_is_folding_once():
    case = zoo.build("gpt", 6)
    model = case.copy()
    ids = [id(m) for m in model.modules()]
    assert fold_lrm(model) is model and [id(m) for m in model.modules()] == ids
    lrm = fold_lrm(zoo.build("gpt", 6, lrm=True).model)
    state = {k: v.clone() for k, v in lrm.state_dict().items()}
    fold_lrm(lrm)
    assert all(torch.equal(v, lrm.state_dict()[k]) for k, v in state.items())


def test_refusals():
    class Scaled(LRMLinear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(GaugeError, match="subclass of LRMLinear"):
        fold_lrm(nn.Sequential(Scaled(4, 4)))
    layer = LRMLinear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", nn.Identity())
    with pytest.raises(GaugeError, match="parametrization"):
        fold_lrm(nn.Sequential(layer))
    with pytest.raises(GaugeError, match="meta device"):
        fold_lrm(nn.Sequential(LRMLinear(4, 4, device="meta")))
    with pytest.raises(GaugeError, match="layer.folded"):
        fold_lrm(LRMLinear(4, 4))


def test_gauge_operations_refuse_a_model_folded_under_them():
    """Folding in place mid-training leaves the optimizer with the removed W̄, r, c: a GaugeFixer or
    GaugeOptimizer built before the fold refuses to act instead of rescaling tensors nobody steps."""
    case = zoo.build("gpt_gqa", 7, lrm=True)
    x = case.inputs
    for folded in (False, True):
        model = case.copy().float().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fixer = gaugeopt.GaugeFixer(model, opt)
        wrapped = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, fix_every=1)
        model(x, x)[1].backward()
        opt.step()
        if folded:
            fold_lrm(model)
            model(x, x)[1].backward()
            with pytest.raises(GaugeError, match="steps none of the parameters"):
                fixer()
            with pytest.raises(GaugeError, match="steps none of the parameters"):
                wrapped.step()
        else:  # control: the same calls on the unfolded model act
            assert fixer().transported
            wrapped.step()
