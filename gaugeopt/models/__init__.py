"""Models and layers shipped with gaugeopt: the project's own nanoGPT-style GPT, and the
learnable-multiplier layer :class:`~gaugeopt.models.lrm.LRMLinear`."""

from gaugeopt.models.gpt import GPT, GPTConfig
from gaugeopt.models.lrm import LRMLinear

__all__ = ["GPT", "GPTConfig", "LRMLinear"]
