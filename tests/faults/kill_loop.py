"""kill -9 during checkpoint writes, resume, repeat: the loop behind the kill tests and soak.py.

`kill_resume_loop` trains the tiny model with a checkpoint every step in one run directory.
Each process is SIGKILLed while it writes a checkpoint (the parent spins on the checkpoint
folder and kills as soon as a temp of the chosen step appears, the dense half's DCP directory
or the commit file's, 2 or 3 steps after the
process's start so every process commits progress first); the next process resumes with
`--resume`. The last one runs to the end. What it reports is what the tests assert: every
kill landed during a write, every start after a kill removed the temp files it left, no temp
file is left at the end, and the losses equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from fault_helpers import Launcher, losses, temp_files, tiny_args, wait_for

from moescale.train.checkpoint import list_checkpoints

STEPS = 40     # the kill, SIGTERM and disk-full tests train this many steps
# the commit file's temp, or the dense half's DCP temp directory (written before it)
OUR_TEMP = re.compile(r"\.ckpt_(\d{8})\.safetensors\..*\.tmp|dense-(\d{8})-[0-9a-f]{8}\.tmp")


@dataclass
class LoopResult:
    kills: int = 0                  # SIGKILLs sent while a checkpoint temp file existed
    resumes: int = 0                # processes started with --resume
    left_after_kill: list[int] = field(default_factory=list)    # temp files after each kill
    left_after_start: list[int] = field(default_factory=list)   # temps of old kills at start
    swept_lines: int = 0            # "removed N temp file(s)" lines of the resumed processes
    final_code: int | None = None
    final_temps: list[str] = field(default_factory=list)
    losses: list = field(default_factory=list)


def loop_args(corpus: Path, run_dir: Path, steps: int, **extra: str) -> list[str]:
    """`moescale train` options of every kill test: the tiny model, a checkpoint every step,
    the newest two kept (the uninterrupted reference run uses the same)."""
    return ["train", *tiny_args(corpus, run_dir, train__steps=str(steps),
                                train__checkpoint_interval="1", train__keep_last="2", **extra)]


def _newest_step(ckpt_dir: Path) -> int:
    found = list_checkpoints(ckpt_dir)
    return found[-1][0] if found else 0


def kill_resume_loop(launcher: Launcher, corpus: Path, run_dir: Path, *, steps: int,
                     kills: int, seed: int = 0, extra: dict | None = None) -> LoopResult:
    """Train `steps` steps in run_dir, SIGKILLing `kills` processes mid-checkpoint-write."""
    rng = random.Random(seed)
    ckpt_dir = run_dir / "checkpoints"
    fresh = loop_args(corpus, run_dir, steps, **(extra or {}))
    out = LoopResult()
    cwd = run_dir.parent
    while True:
        start_step = _newest_step(ckpt_dir)
        resumed = bool(list_checkpoints(ckpt_dir))     # a fresh run saves step 0 first
        argv = ["train", "--resume", str(run_dir)] if resumed else fresh
        old_temps = temp_files(run_dir)
        old_ids = _temp_ids(run_dir, old_temps)
        child = launcher.start(argv, cwd)
        out.resumes += resumed
        if out.kills >= kills:
            out.final_code = child.wait(300)
            break
        target = min(steps, start_step + rng.choice((2, 3)))

        stale = {os.path.basename(t) for t in old_temps}

        def writing(child=child, target=target, stale=stale):
            if not child.proc.is_alive():
                return "exited"
            try:   # a temp the last kill left is not this process writing (it sweeps it)
                names = [OUR_TEMP.fullmatch(n) for n in os.listdir(ckpt_dir) if n not in stale]
            except FileNotFoundError:
                return None
            return "kill" if any(m and int(m.group(1) or m.group(2)) >= target
                                 for m in names) else None

        what = wait_for(writing, timeout=120, poll=0)
        if what == "kill":
            child.proc.kill()
            child.wait()
            out.kills += 1
            out.left_after_kill.append(len(temp_files(run_dir)))
        else:
            out.final_code = child.wait()
            break
        if old_temps:   # the same file still there (a new kill may leave one of that name)
            out.left_after_start.append(len(old_ids & _temp_ids(run_dir, temp_files(run_dir))))
        out.swept_lines += "temp file(s)" in child.text() and bool(old_temps)
    out.final_temps = temp_files(run_dir)
    out.losses = losses(run_dir)
    return out


def _temp_ids(run_dir: Path, names: list[str]) -> set[tuple[str, int, int]]:
    """(name, inode, mtime) of temp files: a swept file written again under the same name (the
    store's temp directories are named by step) is another file."""
    out = set()
    for name in names:
        try:
            st = os.stat(run_dir / name)
        except FileNotFoundError:
            continue
        out.add((name, st.st_ino, st.st_mtime_ns))
    return out


def die_at(where: str, step: int) -> None:
    """A Launcher hook: SIGKILL this process itself the moment a save of `step` reaches
    `where` ("publish": every rank's DCP files are written, no manifest, not renamed;
    "commit": the dense directory is in place, the commit file not yet written)."""
    import signal

    from moescale.train import dense_dcp, saving

    module, name, index = (dense_dcp, "_publish", 2) if where == "publish" else \
        (saving, "save_checkpoint", 1)                 # index: the step argument's
    real = getattr(module, name)

    def hooked(*args, **kwargs):
        if args[index] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, name, hooked)
