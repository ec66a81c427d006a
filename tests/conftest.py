import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/zoo.py and friends


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
