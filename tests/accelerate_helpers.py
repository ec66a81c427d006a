"""An Accelerator per test: Accelerate keeps process-wide singletons (AcceleratorState,
GradientState) that remember the first settings; each test gets fresh ones and leaves none."""

from __future__ import annotations

import pytest


@pytest.fixture
def make_accelerator():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def make(**kw):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return accelerate.Accelerator(cpu=True, **kw)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
