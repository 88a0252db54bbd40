"""A bit flipped in a live disk-tier record file (issue 31, item 3).

A disk-tier run (host cache of two records: most records are read from their files every step)
is stopped with SIGSTOP between checkpoints; one bit of the master row (read by the forward) or
of the exp_avg row (read by the host optimizer's thread) of every expert file of layer 0 that
no checkpoint links (link count 1) is flipped; SIGCONT. The next read of such a
file fails its checksum: the run stops with one line naming the file and byte offset (exit 1),
writes no checkpoint after the bad read, and `--resume` continues from the newest checkpoint
with exactly the losses of the same run never touched. Before: the flipped weights were trained
on and checkpointed, exit 0.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fault_helpers import losses, tiny_args, wait_for

from moescale.train.checkpoint import list_checkpoints

STEPS, EVERY = 40, 5
DISK = dict(train__steps=str(STEPS), train__checkpoint_interval=str(EVERY),
            offload__tier="disk", offload__host_cache_bytes="128KiB")   # two records


def _run(corpus: Path, base: Path) -> list[str]:
    (base / "disk").mkdir(parents=True, exist_ok=True)
    return ["train", *tiny_args(corpus, base / "run", **DISK,
                                offload__directory=str(base / "disk"))]


def _unlinked_files(disk: Path) -> list[Path]:
    """Layer 0's current record files that no checkpoint shares (a flip there is the run's
    alone)."""
    return sorted(p for p in (disk / "layer000").glob("expert*.bin") if p.stat().st_nlink == 1)


def _stop_between_checkpoints(child, run_dir: Path, disk: Path) -> list[Path]:
    """SIGSTOP the run at a moment when its last step is not a checkpoint's nor the one before
    it and layer 0 has unlinked files; returns those files (the run stays stopped)."""
    for _ in range(200):
        os.kill(child.pid, signal.SIGSTOP)
        done = len(losses(run_dir))
        files = _unlinked_files(disk)
        if done >= 7 and done % EVERY in (1, 2, 3) and files and done < STEPS - 5:
            return files
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: len(losses(run_dir)) > done, 10, poll=0.002)
    raise AssertionError(f"no moment between checkpoints found; log:\n{child.text()}")


@pytest.fixture(scope="module")
def alone(launcher, corpus, tmp_path_factory):
    """The losses of the same run with nothing flipped."""
    base = tmp_path_factory.mktemp("alone")
    code, text = launcher.run(_run(corpus, base), base)
    assert code == 0, text
    return losses(base / "run")


ROW_BYTES = 4 * 2 * 32 * 64     # the tiny model's expert: w1 and w2, fp32, 4 KiB aligned


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("row", [0, 1], ids=["master", "exp_avg"])
def test_a_bit_flipped_in_a_live_record_file_stops_the_run_and_the_checkpoint_resumes(
        launcher, corpus, alone, tmp_path, row):
    """row 0: the master, read by the forward's upload; row 1: exp_avg, read by the host
    optimizer's thread for the expert's step."""
    offset = row * ROW_BYTES
    base = tmp_path / "flipped"
    run_dir, disk = base / "run", base / "disk"
    child = launcher.start(_run(corpus, base), tmp_path)
    assert wait_for(lambda: len(losses(run_dir)) >= 7, 60, poll=0.002), child.text()
    try:
        files = _stop_between_checkpoints(child, run_dir, disk)
        saved = list_checkpoints(run_dir / "checkpoints")
        for path in files:                       # one bit of one number of the row each
            with open(path, "r+b") as f:
                f.seek(offset + 1000)
                byte = f.read(1)[0]
                f.seek(offset + 1000)
                f.write(bytes([byte ^ 0x10]))
    finally:
        os.kill(child.pid, signal.SIGCONT)
    code = child.wait()
    text = child.text()
    last = text.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in text, text
    assert text.count("does not match the checksum") == 1, text
    assert any(str(path) in last for path in files), text
    assert "layer 0 expert" in last and f"byte offset {offset:,}" in last, last
    assert f"({('master', 'exp_avg')[row]} row)" in last and "--resume" in last, last
    assert list_checkpoints(run_dir / "checkpoints") == saved   # none after the bad read
    assert not list(run_dir.glob("checkpoints/*.corrupt"))

    code, text = launcher.run(["train", "--resume", str(run_dir)], tmp_path)
    assert code == 0, text
    assert f"(step {saved[-1][0]})" in text, text                # the newest checkpoint
    assert losses(run_dir) == alone                             # bit for bit
