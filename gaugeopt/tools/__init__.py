"""Model tools: canonical forms, equivalence, merging, counting, checkpoints and the CLI."""
