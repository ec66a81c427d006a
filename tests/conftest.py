"""The suite's set-up: tests are grouped by the package they test (``structure/``, ``fix/``,
``projection/``, ``kernels/``, ``tools/``, ``integrations/``), the repository-wide checks in ``project/``
and the recipes' in ``recipes/``; what several of them share — the model zoo (``support/zoo``), the
reference constructions and the helpers — is in ``support/``, importable by module name."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # zoo, the *_helpers, the references


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# The suite's models are tiny: one intra-op thread avoids OpenMP spin-waiting on a shared
# 2-core machine (25x slower in the worst case) and makes CPU results independent of the core count.
torch.set_num_threads(1)
