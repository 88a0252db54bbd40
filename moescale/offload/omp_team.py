"""One thread's own OpenMP team size: the host optimizer's worker runs its torch ops on itself
alone, beside the compute thread's team instead of on top of it.

`torch.set_num_threads` is process-wide, but the OpenMP runtime keeps the team size per thread
(an `omp_set_num_threads` call on a thread sets that thread's own value), and torch's parallel
loops ask it on the calling thread. On a machine with few cores, a worker that steps experts
with a team of its own competes with the forward/backward's team: both wait at barriers for
threads that are not running (on 2 cores, a CPU profile of a disk-tier step found the worker
in the OpenMP runtime's wait in 2,400 of its 6,200 samples).
So the worker of eager steps on a CPU device calls `limit_this_thread(1)` once, after torch has
set up the thread (its first parallel query), and its ops then run inline (deferred steps run
while the compute thread waits for them, so they keep every core). Measured on the past-RAM
disk-tier step with bf16 + int8 state (2 cores, other work paused): 18.7 s with the worker's
own one-thread team, 22.6 s with torch's two-thread teams on both threads.

The call goes to the OpenMP runtime that torch loaded (libgomp, libomp or libiomp5, found among
the process's mapped libraries); where none is found (no /proc, another runtime), nothing
changes and the call says so.

Deliberately not here: which threads call it (optimizer.py).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

RUNTIMES = ("libgomp", "libomp", "libiomp5")


@lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime mapped into this process, or None."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so")
                     or ".so." in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(RUNTIMES):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    return None


def limit_this_thread(threads: int) -> bool:
    """Run this thread's torch ops on a team of `threads`; True if the runtime took it."""
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    torch.get_num_threads()     # torch's per-thread set-up first (it would reset the value)
    lib = _runtime()
    if lib is None:
        return False
    lib.omp_set_num_threads(threads)
    return torch.get_num_threads() == threads
