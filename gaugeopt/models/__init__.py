"""Models shipped with gaugeopt (the project's own nanoGPT-style GPT)."""

from gaugeopt.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
