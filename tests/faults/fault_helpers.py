"""What the fault-injection tests share: real `moescale train` processes to kill, and what to
look at afterwards (temp files, losses, /dev/shm stores).

`Launcher` starts `moescale train` (the CLI's own `main`) in fresh processes forked from a
fork server that imported moescale and torch once, so a process costs a fork, not an import;
they are real processes with their own files and signals, killed with real SIGKILL / SIGTERM.
A few tests also start the real command (`python -m moescale train`) to cover the entry point.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moescale.shared_store.node_store import shm_directory
from train_helpers import TINY, as_argv

TEMP = re.compile(r"\.ckpt_.*\.tmp|\.tmp[A-Za-z0-9]{6}|.*\.tmp")   # ours, safetensors', dirs


def tiny_args(corpus: Path, run_dir: Path, **extra: str) -> list[str]:
    """`moescale train` options of the training tests' tiny model on `corpus` in `run_dir`
    (extra: more `section.option=value` overrides, dots written as '__')."""
    overrides = dict(TINY, **{"data.path": str(corpus), "train.run_dir": str(run_dir),
                              "train.eval_interval": "0"})
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return as_argv(overrides)


def _child(argv: list[str], cwd: str, log: str, env: dict, hook=None) -> None:
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())   # not a semaphore that a SIGKILL would leak
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from moescale.cli import main

    if hook is not None:      # a picklable callable run first (kill_loop.die_at: a fault point)
        hook()
    sys.exit(main(argv))


@dataclass
class Child:
    proc: multiprocessing.Process
    log: Path

    def wait(self, timeout: float = 120.0) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            raise AssertionError(f"still running after {timeout} s; log:\n{self.text()}")
        return self.proc.exitcode

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def pid(self) -> int:
        return self.proc.pid


class Launcher:
    """Starts `moescale <argv>` in processes forked from a server that imported moescale."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["moescale.train.trainer", "torch._dynamo",
                                         "matplotlib.pyplot"])   # what a run imports
        self.started = 0

    def start(self, argv: list[str], cwd: Path, log: Path | None = None,
              env: dict | None = None, hook=None) -> Child:
        self.started += 1
        log = log or Path(cwd) / f"child{self.started}.log"
        proc = self.ctx.Process(target=_child, args=(list(argv), str(cwd), str(log), env or {},
                                                     hook))
        proc.start()
        return Child(proc, log)

    def run(self, argv: list[str], cwd: Path, timeout: float = 120.0) -> tuple[int, str]:
        child = self.start(argv, cwd)
        return child.wait(timeout), child.text()


def rank_env(rank: int, world: int, port: int) -> dict:
    """torchrun's environment for one of `world` local ranks."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def temp_files(run_dir: Path) -> list[str]:
    """Temp files and partial directories under the run directory (relative paths)."""
    found = []
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            if TEMP.fullmatch(name):
                found.append(os.path.relpath(os.path.join(root, name), run_dir))
    return sorted(found)


def wait_for(predicate, timeout: float, poll: float = 0.0005):
    """Spin until predicate() is truthy (returns it) or the time is up (returns None)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if poll:
            time.sleep(poll)
    return None


def shm_stores() -> set[str]:
    """The shared expert stores in the node stores' directory (dynamic placement: /dev/shm,
    or this test session's directory there, see conftest.py)."""
    directory = shm_directory()
    if not os.path.isdir(directory):
        return set()
    return {n for n in os.listdir(directory) if n.startswith("moescale-store-")}


def losses(run_dir: Path) -> list[tuple[int, float, float | None]]:
    """(step, loss, grad_norm) of every train record of metrics.jsonl."""
    from moescale.train.metrics import read_metrics

    return [(r["step"], r["loss"], r["grad_norm"])
            for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
