"""Expert worker threads never oversubscribe the CPUs (issue 13 item 6, issue 15).

`run_on_workers` spreads experts over worker threads that must each run their share of the
thread budget (budget // workers: ONE on a 2-core machine with 2 workers), so that workers x
intra-op threads never exceeds the CPUs:
before the fix a worker's `torch.set_num_threads(1)` was undone by its own lazy OpenMP
initialisation (from the process default the caller had just restored), so on 2 cores two
workers ran two OpenMP threads each, and every call created new OpenMP teams (under load one
creation failed and libgomp aborted the process). These tests look inside real worker threads
of a real MoE forward and backward, and at the process's OS threads across many calls.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from moescale.layers import expert_threads
from moescale.layers.expert_threads import (num_expert_workers, run_on_workers, usable_cpus,
                                            worker_share)
from moescale.layers.moe import MoE


def os_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.fixture
def threads_2():
    if usable_cpus() < 2:
        pytest.skip("needs 2 usable CPUs for 2 expert workers")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_each_worker_runs_one_intra_op_thread(threads_2):
    seen: list[int] = []
    lock = threading.Lock()

    def task() -> None:
        a = torch.randn(96, 96)
        (a @ a).sum()                       # a parallel region: OpenMP is initialised by now
        with lock:
            seen.append(torch.get_num_threads())

    for _ in range(5):
        run_on_workers([task, task])
    assert seen == [1] * 10
    assert torch.get_num_threads() == 2     # the caller's count is restored


def test_workers_never_exceed_the_usable_cpus(threads_2):
    torch.set_num_threads(4 * usable_cpus())
    workers = num_expert_workers(torch.device("cpu"), [3] * (16 * usable_cpus()))
    assert 2 <= workers <= usable_cpus()


def _threads_seen_by_workers(num_tasks: int) -> list[int]:
    seen: list[int] = []
    lock = threading.Lock()

    def task() -> None:
        a = torch.randn(64, 64)
        (a @ a).sum()
        with lock:
            seen.append(torch.get_num_threads())

    run_on_workers([task] * num_tasks)
    return seen


@pytest.mark.parametrize("cpus, tasks", [(4, 2), (4, 3), (6, 3), (8, 2), (2, 2)])
def test_each_worker_runs_its_share_and_the_product_fits_the_cpus(monkeypatch, cpus, tasks):
    """Whatever the CPU count, a worker's torch.get_num_threads() is its share
    (budget // workers) and workers x share never exceeds the CPUs (the CPU count is
    pretended here, so a 2-core machine checks the 8-core arithmetic)."""
    monkeypatch.setattr(expert_threads, "usable_cpus", lambda: cpus)
    before = torch.get_num_threads()
    torch.set_num_threads(cpus)
    try:
        seen = _threads_seen_by_workers(tasks)
    finally:
        torch.set_num_threads(before)
    share = worker_share(cpus, tasks)
    assert share == cpus // tasks
    assert seen == [share] * tasks
    assert tasks * share <= cpus


def test_worker_count_leaves_two_experts_per_worker(monkeypatch):
    monkeypatch.setattr(expert_threads, "usable_cpus", lambda: 8)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        cpu = torch.device("cpu")
        assert num_expert_workers(cpu, [5] * 5) == 2          # 5 experts: 2 workers x 4 threads
        assert num_expert_workers(cpu, [5] * 64) == 8         # many experts: 8 x 1
        assert num_expert_workers(cpu, [5, 0, 0, 7]) == 0     # 2 experts: serial, 8 threads
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_workers"):
        worker_share(8, 0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_moe_forward_backward_keeps_the_thread_count(threads_2):
    """A real MoE layer on 2 threads: in every worker call the expert activation sees one
    intra-op thread, and 30 forward + backward passes leave the process's OS thread count
    where the first pass left it."""
    inside: list[int] = []

    def act(h):
        inside.append(torch.get_num_threads())
        return torch.relu(h)

    torch.manual_seed(0)
    moe = MoE(32, 8, 2, d_ff=64, activation=act)
    x = torch.randn(256, 32)
    moe(x).square().mean().backward()
    baseline = os_threads()
    for _ in range(30):
        moe(x).square().mean().backward()
        assert os_threads() <= baseline + 2    # the call's own 2 workers at most, never teams
    assert inside and set(inside) == {1}
