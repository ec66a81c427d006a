"""A tiny GQA Llama with learnable multipliers, token data and quiet TrainingArguments, for the
Hugging Face Trainer tests (built from a config: no hub access)."""

from __future__ import annotations

import torch
import transformers

import gaugeopt

VOCAB, T = 64, 16


def tiny_llama(seed: int = 0, lrm: bool = True, **cfg) -> transformers.LlamaForCausalLM:
    """2 layers, 8 query heads sharing 2 KV heads (GQA: each K multiplier receives the sum of four
    query heads' gradients, so Adam moves the two sides of a group apart), RoPE split-half."""
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **cfg}))
    return gaugeopt.apply_lrm(model) if lrm else model


class Tokens(torch.utils.data.Dataset):
    """Sequences with a learnable pattern (next token = token + 1 mod V, 10% noise)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        seq = (start + torch.arange(T)) % VOCAB
        noise = torch.rand(seq.shape, generator=g) < 0.1
        self.x = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def condition_b(model, lr: float = 1e-2) -> torch.optim.AdamW:
    """AdamW on paper 002's condition B groups: no weight decay on the Q/K multipliers."""
    return torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B"), lr=lr, betas=(0.9, 0.95))


def arguments(out_dir, steps: int = 60, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, lr_scheduler_type="constant", report_to="none", save_strategy="no", logging_steps=10,
        disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0,
    )
    return transformers.TrainingArguments(**{**base, **kw})


def trainer(model, args, callbacks=(), optimizer=None, n: int = 480) -> transformers.Trainer:
    opt = condition_b(model, args.learning_rate) if optimizer is None else optimizer
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(n), optimizers=(opt, None),
                                callbacks=list(callbacks))
