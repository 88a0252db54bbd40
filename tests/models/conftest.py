"""Fixtures for tests/models: run torch single-threaded while these tests run.

On a shared 2-core machine, torch's intra-op thread pool makes the tiny GEMMs of these tests
10-100x slower under contention (threads spin waiting for each other); one thread is both
faster and deterministic. The previous thread count is restored after each test.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
