"""A fresh Accelerator: Accelerate keeps process-wide singletons (AcceleratorState, GradientState)
that remember the settings and the dataloader state of the last run in the process."""

from __future__ import annotations


def fresh_accelerator(**kw):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kw)
