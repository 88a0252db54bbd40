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


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_two_workers_step_as_one(mode):
    """Two workers (an expert's tasks on one of them, in order; deferred groups per worker)
    give bitwise the masters, moments and step counts of one worker, over 3 iterations with
    two accumulations each."""
    from moescale.offload.optimizer import AdamWConfig, HostOptimizer
    from moescale.offload.state_format import StateFormat
    from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig
    results = []
    for workers in (1, 2):
        store = ExpertStore(StoreConfig(tier="host", state=StateFormat(master="bf16",
                                                                      moments="int8", seed=3)))
        gen = torch.Generator().manual_seed(0)
        store.add_layer(ExpertLayout([("w", (6, 300))]), 5, lambda e: torch.randn(1800,
                                                                                 generator=gen))
        opt = HostOptimizer(store, AdamWConfig(lr=1e-2), mode, worker_threads=1,
                            workers=workers)
        try:
            for _ in range(3):
                for last in (False, True):
                    for e in range(5):
                        grad = torch.randn(6, 300, generator=gen)
                        opt.accumulate((0, e), [grad], last=last)
                opt.step_all()
            opt.wait_all()
            results.append([torch.cat([t.float().reshape(-1) for t in store.get_state((0, e))])
                            for e in range(5)] + [store.step_of((0, e)) for e in range(5)])
        finally:
            opt.close()
            store.close()
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(*results, strict=True))
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        HostOptimizer(store, AdamWConfig(), workers=0)
