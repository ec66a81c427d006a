"""The layouts the outside families brought, through the rest of gaugeopt: GaugeFix, the exact
projection (against least squares on explicitly built generators) and canonical forms, on one
representative of each — a per-head fused QKV with partial RoPE (GPT-NeoX), a grouped QKV with one
KV head (Falcon), projections reached through nested paths with O in a sibling module (BERT),
``d_kv`` independent of the width with cross-attention and a fixed head order (T5), a declared
``nn.Linear`` subclass with interleaved RoPE (torchtitan), and multipliers on nanoGPT. The checks
are the suite's own (tests/fix/test_gaugefix.py, tests/projection/test_projection.py,
tests/tools/test_canonical.py),
run on these models."""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import zoo.families as zf
from gaugeopt import GaugeError
from model_tools_helpers import attention_change
from paths import suite_module

test_canonical = suite_module("tools/test_canonical.py")
test_gaugefix = suite_module("fix/test_gaugefix.py")
test_projection = suite_module("projection/test_projection.py")


@pytest.fixture(autouse=True)
def _float64_rope():
    with zf.float64_islands_removed():  # torchtitan rotates in float32 otherwise (precision only)
        yield


@pytest.mark.parametrize("name, lrm", [("hf_gpt_neox", False), ("hf_bert", False), ("hf_t5", False), ("nanogpt", True)])
def test_gaugefix_balances_and_preserves_the_function(name, lrm):
    test_gaugefix.test_fix_balances_every_slot_and_preserves_logits(name, lrm, torch.float64)


@pytest.mark.parametrize("name, sector", [("hf_gpt_neox", "qk"), ("hf_gpt_neox", "vo"), ("hf_falcon_new_mqa", "qk"),
                                          ("hf_t5", "vo"), ("torchtitan_separate", "qk")])
def test_exact_projection_is_least_squares(name, sector):
    test_projection.test_exact_projection_matches_least_squares(name, False, sector)


@pytest.mark.parametrize("name", ["hf_gpt_neox", "hf_falcon_new_mqa"])
def test_canonical_form_preserves_the_function(name):
    test_canonical.test_function_and_section_equations({name: zf.build(name, 3)}, name, "qr")


def test_canonical_form_keeps_heads_tied_to_their_positions():
    """T5's heads may not be permuted: sorting them is refused by name, the canonical form without
    sorting preserves the function."""
    case = zf.build("hf_t5", 3)
    with pytest.raises(GaugeError, match="may not be permuted"):
        gaugeopt.canonicalize(case.model)
    canon = gaugeopt.canonicalize(case.model, sort_heads=False).model
    assert gaugeopt.relative_change(case.logits(), case.logits(canon)) <= 1e-10
    assert attention_change(case, canon) <= 1e-10
