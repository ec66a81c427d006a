"""Helpers shared by the training and slurm tests: a prepared corpus and a test-sized tiny config."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "recipes" / "configs"

# Smaller than the demo's tiny model so a few dozen CPU steps take about a second.
TEST_MODEL = [
    "model.n_layer=2", "model.n_embd=64", "model.block_size=64",
    "data.micro_batch_size=8", "data.val_batches=4", "train.progress=none",
]


def prepare_corpus(folder: Path) -> Path:
    """The built-in pydoc corpus, character-tokenized, through the recipe's on-the-fly preparation."""
    from recipes.config import load_config
    from recipes.train import _ensure_data

    cfg = load_config(CONFIGS / "tiny_cpu_A.yaml",
                      [f"data.dir={folder}", "data.prepare={source: builtin, corpus: pydoc, tokenizer: char}"])
    _ensure_data(cfg, rank=0)
    return folder


def tiny(condition: str, data_dir: Path, out_dir: Path, *overrides: str):
    """``recipes/configs/tiny_cpu_<condition>.yaml`` at test size on ``data_dir``, runs under ``out_dir``."""
    from recipes.config import load_config

    return load_config(CONFIGS / f"tiny_cpu_{condition}.yaml",
                       [f"data.dir={data_dir}", "data.prepare=null", f"train.out_dir={out_dir}", *TEST_MODEL, *overrides])


def series(rows: list[dict[str, float]], key: str) -> dict[int, float]:
    """``{step: value}`` of the rows that hold ``key``."""
    return {int(r["step"]): r[key] for r in rows if key in r}
