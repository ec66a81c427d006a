"""Finding the records: which module classes are attention, and how each one's tensors are laid out.

* :mod:`.find` — :func:`gaugeopt.find_attention` and :func:`gaugeopt.register_adapter`;
* :mod:`.table` — the adapter tables (user-registered, built in, recognisers);
* :mod:`.builtin` — registers the built-in adapters, one module per library: :mod:`.gpt`,
  :mod:`.nanogpt`, :mod:`.hf`, :mod:`.hf_recent`, :mod:`.mla`, :mod:`.qk_norm`, :mod:`.litgpt`,
  :mod:`.timm`, :mod:`.torch_mha`, :mod:`.torchtitan`, :mod:`.x_transformers` (never importing those libraries);
* :mod:`.spec` — :class:`~gaugeopt.AttentionSpec`, the declarative adapter;
* :mod:`.recognise` — a renamed copy of a verified class, recognised by comparing code objects;
* :mod:`.stock` — provenance: is the code a module runs the code its library ships;
* :mod:`.apply_lrm` — :func:`gaugeopt.apply_lrm` and :func:`gaugeopt.lrm_param_groups`.

An adapter is right for the stock class; :mod:`gaugeopt.trust` proves it right for a given model.
"""
