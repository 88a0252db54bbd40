"""torch's intra-op thread count for a run: the automatic choice and a scoped setting.

`auto_threads` is `train.threads = 0` (and `moescale generate --threads 0`): the CPUs the load
average leaves free. `torch_threads(n)` sets torch's count for a block and restores it: the
trainer holds its count from the model build to the end of `run()`, since building (expert
init, the meta-device memory check, resuming a checkpoint) is torch work too. On a busy machine
torch's default, one thread per core, is far slower than fewer threads: every parallel region
waits for all of its threads to be scheduled (a 4.5M-parameter model built in ~1 s with 2 threads
in a process forked on a loaded 2-core machine, 0.07 s with 1).
"""

from __future__ import annotations

import contextlib
import os

import torch

from moescale.layers.expert_threads import thread_budget


def auto_threads(ranks: int = 1) -> tuple[int, str]:
    """Threads for `train.threads = 0`: the CPUs left free by the current load average.

    On a busy machine torch's default (one thread per core) is far slower than fewer threads:
    every parallel region waits for all its threads to be scheduled. The choice is recorded
    in each checkpoint (config.toml keeps 0, so --config of it chooses again), so a resumed run
    uses the same count (and the same floats)."""
    cpus = max(1, thread_budget() // ranks)     # torch's count, at most the usable CPUs
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cpus, f"auto: {cpus} CPUs"
    threads = max(1, min(cpus, int(cpus - load + 0.5)))
    return threads, f"auto: {cpus} CPUs, load average {load:.1f}"


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch.set_num_threads(threads) for the block; the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
