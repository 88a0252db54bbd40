"""Run a function on N local ranks (real processes, real process group) and collect results.

`run_local(fn, world_size, args)` is the Python-API twin of `torchrun --nproc-per-node N`: each
rank is a fresh process with torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port) and an initialized default process group;
`fn(rank, world_size, *args)` runs there and its (picklable) return value comes back.

Processes start from a fork server that has imported torch once, so a rank costs a fork, not
a torch import. The parent never hangs: a rank that raises reports its traceback, a rank that
dies is noticed by its exit code, and ranks still running at `deadline_s` are killed. With
`raise_on_error=False` every rank's outcome is returned instead of raising (tests use this to
check how the surviving ranks fail when one dies).

It does not restart ranks and does not span machines (use torchrun for that).
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None       # traceback text, or how the process ended
    exitcode: int | None = None
    seconds: float = 0.0           # from the start of the launch to the report


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, backend, timeout_s, args, results, t0,
           init_group) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        if init_group:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value, None, time.time() - t0))
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        results.put((rank, False, None, traceback.format_exc(), time.time() - t0))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a dead peer can make teardown fail; the result is sent
                pass


def run_local(fn: Callable, world_size: int, args: tuple = (), *, backend: str = "gloo",
              timeout_s: float = 30.0, deadline_s: float = 120.0,
              raise_on_error: bool = True, init_group: bool = True,
              preload: tuple[str, ...] = ()) -> list[RankResult]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; results in rank order.

    timeout_s: the process-group timeout (a collective waiting longer raises in that rank).
    deadline_s: wall time after which ranks still running are killed (reported as errors).
    init_group: False leaves the default group to `fn` (torchrun's variables are set).
    preload: modules the fork server imports once besides torch and this module (whose
    package every rank imports anyway: ~0.5 s a rank otherwise), when this call starts the
    process's fork server; a running one is reused as is.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, *preload])
    results = ctx.Queue()
    port, t0 = free_port(), time.time()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, backend, timeout_s, args, results, t0,
                               init_group))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, RankResult] = {}
    exited_at: dict[int, float] = {}
    while len(outcome) < world_size:
        try:
            rank, ok, value, error, seconds = results.get(timeout=0.05)
            outcome[rank] = RankResult(rank, ok, value, error, seconds=seconds)
            continue
        except queue_mod.Empty:
            pass
        now = time.time()
        for r, p in enumerate(procs):
            if r in outcome or p.exitcode is None:
                continue
            exited_at.setdefault(r, now)
            if now - exited_at[r] > 1.0:  # its queue feeder had time to flush
                outcome[r] = RankResult(r, False, error=f"rank {r} exited with code "
                                        f"{p.exitcode} without reporting a result",
                                        exitcode=p.exitcode, seconds=now - t0)
        if now - t0 > deadline_s:
            for r, p in enumerate(procs):
                if r not in outcome:
                    p.kill()
                    outcome[r] = RankResult(r, False, error=f"rank {r} still running after "
                                            f"deadline_s={deadline_s}; killed", seconds=now - t0)
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)
    for r, p in enumerate(procs):
        outcome[r].exitcode = p.exitcode
    ordered = [outcome[r] for r in range(world_size)]
    if raise_on_error:
        failed = [res for res in ordered if not res.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {world_size} ranks failed; first: rank "
                               f"{failed[0].rank}:\n{failed[0].error}")
    return ordered
