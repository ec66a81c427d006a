"""Saving a model with learnable multipliers through the training integrations warns, and the export
the warning names (``fold_lrm`` on a copy) loads in stock transformers as the trained function.

The checkpoints themselves keep ``W̄``, ``r``, ``c`` (resuming needs them) and the training model is
never folded; the controls: the same runs on models without multipliers stay silent.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file

import gaugeopt
from gaugeopt.callbacks import GaugeFix
from gaugeopt.integrations.transformers import GaugeFixCallback
from gaugeopt.models.lrm import LRMExportWarning, LRMLinear
from lightning_helpers import TinyLit, token_loader
from lightning_helpers import trainer as lightning_trainer
from trainer_helpers import Tokens, arguments, tiny_llama
from trainer_helpers import trainer as hf_trainer


def _export_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, LRMExportWarning)]


def test_hf_trainer_checkpoints_warn_and_the_named_export_loads_in_stock_transformers(tmp_path):
    model = tiny_llama(lrm=True)
    args = arguments(tmp_path / "run", steps=2, save_strategy="steps", save_steps=2)
    trainer = hf_trainer(model, args, [GaugeFixCallback(every=1)], n=16)
    found = _export_warnings(trainer.train)
    assert any("the Trainer's checkpoints" in m for m in found) and any("after training" in m for m in found)
    assert all("gaugeopt.fold_lrm(copy.deepcopy(model)).save_pretrained(path)" in m for m in found)
    assert any(isinstance(m, LRMLinear) for m in trainer.model.modules())  # the training model is not folded
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert any("row_mults" in k for k in saved)  # the checkpoint keeps what resuming needs

    gaugeopt.fold_lrm(copy.deepcopy(trainer.model)).save_pretrained(tmp_path / "export")
    stock = type(model).from_pretrained(tmp_path / "export").eval()
    x = Tokens(4, seed=1).x
    with torch.no_grad():
        want, got = trainer.model.eval()(input_ids=x).logits, stock(input_ids=x).logits
    assert gaugeopt.relative_change(want, got) <= 1e-5  # float32 training model, one rounding per weight


def test_hf_trainer_without_multipliers_is_silent(tmp_path):
    model = tiny_llama(lrm=False)
    args = arguments(tmp_path / "run", steps=2, save_strategy="steps", save_steps=2)
    trainer = hf_trainer(model, args, [GaugeFixCallback(every=1)], optimizer=torch.optim.AdamW(model.parameters()),
                         n=16)
    assert _export_warnings(trainer.train) == []


@pytest.mark.parametrize("lrm", [True, False])
def test_lightning_checkpoints_warn_only_with_multipliers(tmp_path, lrm):
    module = TinyLit(lrm=lrm)
    trainer = lightning_trainer(tmp_path, max_steps=2, enable_checkpointing=True, callbacks=[GaugeFix(every=1)])
    found = _export_warnings(lambda: trainer.fit(module, token_loader(2)))
    assert bool(found) is lrm and all("Lightning's checkpoint" in m for m in found)
    assert any(isinstance(m, LRMLinear) for m in module.modules()) is lrm
