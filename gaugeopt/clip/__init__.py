"""QK-Clip and the attention-logit reader it is fed by.

* :mod:`.logits` — :func:`gaugeopt.max_attention_logits`: each query head's largest ``q·k`` logit
  on a real batch, checked against the module's own scores;
* :mod:`.scores` — what an attention call adds to ``q·k`` (scale, RoPE angles, masks), read off the call;
* :mod:`.qk_clip` — :func:`gaugeopt.qk_clip`: heads over ``τ`` rescaled, the optimizer state transported.

docs/stability.md has the rule, the options and the evidence.
"""
