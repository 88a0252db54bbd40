"""Run per-expert CPU work on several threads whose intra-op threads together fit the CPUs.

Many small per-expert GEMMs lose much of their time at the end-of-op barrier of torch's
intra-op thread team, and badly so when the cores are shared with other processes: one thread
of the team is descheduled and the others wait at every GEMM. Measured on a busy 2-core VM:
64 experts x 128-row GEMMs took 3.8x as long as one dense GEMM of the same size with the
2-thread team, 1.4x with two workers of one thread each taking whole experts. This module
gives each of N worker threads whole experts (grouped_ffn hands them out largest first from
one queue, so a descheduled worker does not hold up the others; `balance_experts` is the
static LPT split), so the only synchronisation left is one lock per expert and the final join.

Thread budget: B = min(torch's intra-op thread count, the usable CPUs). N = min(B, non-empty
experts // 2) workers (none when N < 2), and each worker runs `worker_share(B, N)` = B // N
intra-op threads, so workers x threads per worker never exceeds B (on a 2-core machine: two
workers of one thread each).

Thread-count mechanics: `torch.set_num_threads(1)` in a worker sets that thread's OpenMP and MKL
thread counts (thread-local) and torch's process-wide default for threads created later (the
same holds for `set_num_threads(share)`); the
caller restores the latter as soon as every worker has started, so its own settings and those
of other threads are unchanged. A new thread initialises its OpenMP count lazily, from the
process-wide default, at its first parallel region (or `torch.get_num_threads()`); a worker
triggers that initialisation before it sets its share, or the caller's restore would win and
every worker would run the caller's whole thread team (2 workers x 2 OpenMP threads on 2
cores, and a new OpenMP team for every worker of every call). So each call runs at most B
compute threads, never more than the CPUs this process may use (`usable_cpus`), and, with a
share of 1 (always so when workers = CPUs), creates no OpenMP team; a share above 1 (many
cores, few experts) costs one team per worker per call. Workers run under `torch.no_grad()`
(grad mode is per thread) and with autocast off (its state is per thread too).

Used only on CPU tensors, with more than one intra-op thread, and with at least two non-empty
experts per worker; never nested (a worker's tasks run kernels, not other worker calls). Accelerators run
the serial loop (their kernels queue asynchronously). This file knows nothing about FFNs.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

import torch


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count() elsewhere)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def thread_budget() -> int:
    """Compute threads one call may run: torch's intra-op count, at most the usable CPUs."""
    return max(1, min(torch.get_num_threads(), usable_cpus()))


def num_expert_workers(device: torch.device, counts: Sequence[int]) -> int:
    """How many worker threads to use for these per-expert row counts (0: run serially):
    at most the thread budget, with at least two non-empty experts per worker."""
    if device.type != "cpu" or torch.compiler.is_compiling():   # no threads in a traced graph
        return 0
    workers = min(thread_budget(), sum(1 for n in counts if n) // 2)
    return workers if workers >= 2 else 0


def worker_share(budget: int, num_workers: int) -> int:
    """Intra-op threads per worker: budget // workers (at least 1), so that
    workers x share <= budget."""
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    return max(1, budget // num_workers)


def balance_experts(counts: Sequence[int], num_workers: int) -> list[list[int]]:
    """Non-empty experts split over workers, largest first onto the least loaded (LPT);
    each worker's experts in ascending order."""
    loads = [0] * num_workers
    groups: list[list[int]] = [[] for _ in range(num_workers)]
    for e in sorted((e for e, n in enumerate(counts) if n), key=lambda e: -counts[e]):
        w = min(range(num_workers), key=loads.__getitem__)
        groups[w].append(e)
        loads[w] += counts[e]
    return [sorted(g) for g in groups if g]


def run_on_workers(tasks: Sequence[Callable[[], None]]) -> None:
    """Run each task on its own thread with `worker_share` intra-op threads (1 when there are
    as many tasks as CPUs); re-raise the first error."""
    caller_threads = torch.get_num_threads()
    share = worker_share(thread_budget(), len(tasks))
    started = threading.Barrier(len(tasks) + 1)
    errors: list[BaseException] = []

    def body(task: Callable[[], None]) -> None:
        try:
            torch.get_num_threads()   # this thread's lazy OpenMP init happens now, not later
            torch.set_num_threads(share)
        finally:
            started.wait()
        try:
            with torch.no_grad():
                task()
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            errors.append(err)

    workers = [threading.Thread(target=body, args=(t,), daemon=True) for t in tasks]
    for w in workers:
        w.start()
    started.wait()
    torch.set_num_threads(caller_threads)   # restore the process-wide default
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
