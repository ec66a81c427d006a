"""A tiny LRM GPT as a LightningModule, and quiet Trainer defaults, for the callback tests."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import gaugeopt
from gaugeopt.models import GPT, GPTConfig

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
warnings.filterwarnings("ignore", ".*litlogger.*")

VOCAB, T = 32, 16


def tiny_config(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return GPTConfig(**{**base, **kw})


def token_loader(n_batches: int, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Random token sequences with a learnable pattern (next token = token + 1 mod V)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_batches * batch_size, 1), generator=g)
    seq = (start + torch.arange(T + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=batch_size, shuffle=False)


class TinyLit(pl.LightningModule):
    """LRM GPT (GQA) trained with AdamW on paper 002's condition B groups (no decay on r_Q, r_K).

    GQA because a balanced Q/K multiplier pair never drifts in exact arithmetic with one K per
    query head (the per-channel gradient identity r_Q ∂L/∂r_Q = r_K ∂L/∂r_K keeps r_Q = r_K);
    with shared K heads Adam's per-coordinate steps make the group scales drift apart.
    """

    def __init__(self, lr: float = 3e-3, lrm: bool = True, condition: str = "B", **cfg) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(tiny_config(**cfg))
        if lrm:
            gaugeopt.apply_lrm(self.model)
        self.lr, self.lrm, self.condition = lr, lrm, condition

    def forward(self, x):
        return self.model(x)[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        groups = gaugeopt.lrm_param_groups(self.model, self.condition) if self.lrm else self.model.parameters()
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))


def trainer(tmp_path=None, **kw) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    if tmp_path is not None:
        defaults["default_root_dir"] = str(tmp_path)
    return pl.Trainer(**{**defaults, **kw})
