"""Training recipes built on gaugeopt: data preparation, configs, Lightning training, the CPU demo."""
