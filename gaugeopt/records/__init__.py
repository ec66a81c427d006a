"""What one attention layer is: the records every gauge computation reads and writes through.

* :mod:`.site` — :class:`~gaugeopt.AttentionSite` (one record per attention layer), :class:`TensorRef`
  (a view recipe into one stored parameter), :class:`ProjectionRefs` (the tensors of Q, K, V or O) and
  :class:`QKNorm`; the canonical layouts are pinned there once;
* :mod:`.pair` — the two sides of a gauge sector (which tensors a group element moves, and how);
* :mod:`.bias_sector` — the bias sectors of a record (key-bias shift, value-bias trade);
* :mod:`.latent` — multi-head latent attention's shared RoPE key and latent spaces;
* :mod:`.rope` — rotation planes and the RoPE commutant;
* :mod:`.linears` — linear-like modules and fused row layouts, for building records.

Records know nothing of how they were found (:mod:`gaugeopt.adapters`), which group acts on them
(:mod:`gaugeopt.sectors`) or whether they were proved (:mod:`gaugeopt.trust`).
"""
