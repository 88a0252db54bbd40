"""Offloading tests run torch on one intra-op thread: on a loaded 2-core machine OpenMP's
spinning makes tiny GEMMs ~40x slower with 2 threads, and our own copy/optimizer/IO threads
already provide the concurrency these tests exercise."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
