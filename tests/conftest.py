import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/zoo.py and friends


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# The suite's models are tiny: one intra-op thread avoids OpenMP spin-waiting on a shared
# 2-core machine (25x slower in the worst case) and makes CPU results independent of the core count.
torch.set_num_threads(1)
