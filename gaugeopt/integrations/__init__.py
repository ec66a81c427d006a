"""gaugeopt inside training stacks: the optimizer wrapper, the framework-free step core, Lightning
and Hugging Face Trainer callbacks, torchmetrics.

``optim`` (:class:`gaugeopt.GaugeOptimizer`), ``steps`` (counting real optimizer steps, the
GaugeFix and projection actions) and ``clip`` (QK-Clip on the same step core) import only torch. ``lightning``, ``transformers`` and
``metrics`` import their framework on import; the core never imports them.
"""
