"""gaugeopt inside training stacks: the optimizer wrapper, Lightning callbacks, torchmetrics.

Each module imports its framework (Lightning, torchmetrics) on import; the core never does.
"""
