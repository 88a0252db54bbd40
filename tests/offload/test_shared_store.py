"""A host store in shared memory is one copy for several local processes: a spawned process
attaches to it, steps an expert with the host optimizer, and the parent sees the new master,
moments and step count without any copy back."""

import pytest
import torch
import torch.multiprocessing as mp

from moescale.offload.optimizer import AdamWConfig, HostOptimizer
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

LAYOUT = ExpertLayout([("w", (4, 3))])


def _child(state, queue):
    store = ExpertStore.attach(StoreConfig(tier="host", shared_memory=True), [LAYOUT], state)
    opt = HostOptimizer(store, AdamWConfig(lr=0.1, impl="single"), mode="deferred")
    rec = store.acquire((0, 1))
    rec.grad_P.fill_(1.0)
    opt.step_all()
    opt.wait_all()
    opt.close()
    queue.put(store.acquire((0, 1)).master_P.tolist())  # plain data: no fd hand-over


@pytest.mark.timeout(120)
def test_a_second_process_steps_the_shared_copy():
    store = ExpertStore(StoreConfig(tier="host", shared_memory=True))
    store.add_layer(LAYOUT, 3, lambda e: torch.full((12,), float(e)))
    before = store.acquire((0, 1)).master_P.clone()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(store.shared_state(), queue))
    proc.start()
    child_master = torch.tensor(queue.get(timeout=100))
    proc.join(timeout=30)
    assert proc.exitcode == 0
    rec = store.acquire((0, 1))
    assert torch.equal(rec.master_P, child_master) and not torch.equal(rec.master_P, before)
    assert float(rec.step_t) == 1.0 and torch.all(rec.exp_avg_P != 0)
    assert torch.all(rec.grad_P == 0)  # the child's step zeroed the shared accumulator
    assert float(store.acquire((0, 0)).step_t) == 1.0  # every expert stepped, as AdamW would


def test_shared_state_needs_shared_host_memory():
    with pytest.raises(ValueError, match="shared_memory"):
        ExpertStore(StoreConfig(tier="host")).shared_state()
