"""The host optimizer's worker runs its torch ops on a team of its own (offload/omp_team.py):
the limit holds on that thread only, the compute thread keeps torch's setting, and a CPU-device
engine's worker takes it."""

import threading

import pytest
import torch

from moescale.offload.omp_team import _runtime, limit_this_thread

needs_runtime = pytest.mark.skipif(_runtime() is None, reason="no OpenMP runtime found")


@needs_runtime
def test_the_limit_holds_on_the_calling_thread_only():
    before = torch.get_num_threads()
    seen = {}

    def worker():
        seen["took"] = limit_this_thread(1)
        torch.randn(1 << 20).mul_(2.0)        # a parallel-sized op: still one thread after it
        seen["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert seen == {"took": True, "threads": 1}
    assert torch.get_num_threads() == before


@needs_runtime
def test_a_cpu_device_engine_steps_on_a_one_thread_team():
    from moescale.offload.optimizer import AdamWConfig, HostOptimizer
    from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig
    store = ExpertStore(StoreConfig(tier="host"))
    store.add_layer(ExpertLayout([("w", (4,))]), 1, lambda e: torch.zeros(4))
    opt = HostOptimizer(store, AdamWConfig(), worker_threads=1)
    try:
        assert opt._workers[0].submit(torch.get_num_threads).result(timeout=60) == 1
    finally:
        opt.close()
        store.close()


def test_bad_team_size_refused():
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        limit_this_thread(0)
