"""`node_expert_store` on 2 gloo ranks: rank 0 creates the shared store in a tmpfs directory,
rank 1 maps it (it reads rank 0's masters and its writes reach rank 0), the file name is gone
once both mapped; a directory that does not exist fails on every rank with a ValueError."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moescale.layers.moe import MoE
from moescale.parallel.launch import run_local
from moescale.shared_store.node_store import shm_directory

pytestmark = pytest.mark.distributed


def _store_rank(rank: int, world: int, directory: str):
    from moescale.offload.store import MASTER
    from moescale.shared_store.experts import expert_master
    from moescale.shared_store.node_store import node_expert_store

    torch.manual_seed(rank)          # rank 1's own experts differ: only rank 0's may count
    moes = [MoE(8, 4, 2, d_ff=16), MoE(8, 6, 2, d_ff=12, glu=True)]
    try:
        store = node_expert_store(moes, None, directory)
    except ValueError as err:
        return "ValueError: " + str(err)
    left = sorted(n for n in os.listdir(directory) if n.startswith("moescale-store-"))
    masters = [[store.acquire((i, e)).data_4P[MASTER].clone() for e in range(m.num_experts)]
               for i, m in enumerate(moes)]
    dist.barrier()                   # both have read the masters before rank 1 writes
    if rank == 1:
        store.acquire((1, 5)).data_4P[MASTER, 0] = 42.0
    dist.barrier()
    seen = float(store.acquire((1, 5)).data_4P[MASTER, 0])
    if rank == 0:
        assert all(torch.equal(masters[i][e], expert_master(m.experts, e))
                   for i, m in enumerate(moes) for e in range(m.num_experts))
    return left, seen, [torch.stack(layer).sum().item() for layer in masters]


@pytest.mark.timeout(60)
def test_node_store_is_shared_and_leaves_no_file(tmp_path):
    directory = shm_directory() if os.path.isdir(shm_directory()) else str(tmp_path)
    results = run_local(_store_rank, 2, (directory,), timeout_s=20, deadline_s=50)
    (left0, seen0, sums0), (left1, seen1, sums1) = [r.value for r in results]
    assert seen0 == seen1 == 42.0             # rank 1's write is rank 0's memory
    assert sums0 == sums1                     # both read rank 0's experts
    assert not any(n in left0 or n in left1 for n in os.listdir(directory)
                   if n.startswith("moescale-store-"))   # names from this run are gone


@pytest.mark.timeout(60)
def test_missing_directory_fails_on_every_rank(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    results = run_local(_store_rank, 2, (missing,), timeout_s=20, deadline_s=50)
    for r in results:
        assert r.value.startswith("ValueError") and "no-such-dir" in r.value, r.value
