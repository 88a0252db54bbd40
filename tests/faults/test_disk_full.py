"""The run directory's disk fills up, or turns read-only, mid-run (issue 13, item 4).

A full disk is simulated with RLIMIT_FSIZE lowered on the running process (`prlimit`: writes
past the limit fail with EFBIG; Python ignores SIGXFSZ), which works without privileges; a
read-only directory with the immutable attribute (`chattr +i`, where the file system and the
user allow it). Either way the run stops with one line (exit 1), keeps every checkpoint
written before (they verify), leaves no temp file (a read-only folder may keep one: the resumed
start removes it), and resumes, once space is back, to the losses of an uninterrupted run.
Before the fix the exit was a chained traceback.
"""

from __future__ import annotations

import resource
import shutil
import subprocess

import pytest
from fault_helpers import losses, temp_files, wait_for
from kill_loop import STEPS, loop_args

from moescale.train.checkpoint import list_checkpoints, load_checkpoint


def _stop_when(launcher, corpus, tmp_path, cut):
    """Start the kill tests' run, let it commit 3 checkpoints, apply `cut(pid, run_dir)`;
    returns (exit code, log, run_dir)."""
    run_dir = tmp_path / "run"
    child = launcher.start(loop_args(corpus, run_dir, STEPS), tmp_path)
    assert wait_for(lambda: len(losses(run_dir)) >= 3, 60, poll=0.001), child.text()
    cut(child.pid, run_dir)
    return child.wait(), child.text(), run_dir


def _check_stopped_cleanly(code, text, run_dir, temps_allowed=False):
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 1, text
    assert "Traceback" not in text and lines[-1].startswith("moescale train: error: "), text
    assert f"--resume {run_dir}" in lines[-1]
    assert temps_allowed or temp_files(run_dir) == []
    found = list_checkpoints(run_dir / "checkpoints")
    assert found and found[-1][0] < STEPS
    for _, path in found:
        load_checkpoint(path)
    return lines[-1]


def _resume_to_the_end(launcher, run_dir, tmp_path, reference):
    code, text = launcher.run(["train", "--resume", str(run_dir)], tmp_path)
    assert code == 0, text
    assert temp_files(run_dir) == []
    assert losses(run_dir) == reference


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_full_disk_mid_run_stops_in_one_line_and_resumes_bitwise(launcher, corpus, reference,
                                                                 tmp_path):
    def fill(pid, run_dir):       # a checkpoint is ~600 KB: the next one cannot be written
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (100_000, 100_000))

    code, text, run_dir = _stop_when(launcher, corpus, tmp_path, fill)
    line = _check_stopped_cleanly(code, text, run_dir)
    assert "could not write the checkpoint of step" in line and "File too large" in line
    _resume_to_the_end(launcher, run_dir, tmp_path, reference)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr")
def test_read_only_checkpoint_folder_mid_run_stops_in_one_line(launcher, corpus, reference,
                                                               tmp_path):
    """A temp file the write had begun may stay (a read-only folder keeps it); the resumed
    start, in the writable folder again, removes it."""
    frozen = []

    def freeze(pid, run_dir):
        ckpts = run_dir / "checkpoints"
        if subprocess.run(["chattr", "+i", str(ckpts)], capture_output=True).returncode:
            return
        frozen.append(ckpts)

    try:
        code, text, run_dir = _stop_when(launcher, corpus, tmp_path, freeze)
    finally:
        for path in frozen:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    if not frozen:
        pytest.skip("this file system or user cannot set the immutable attribute")
    line = _check_stopped_cleanly(code, text, run_dir, temps_allowed=True)
    assert "could not write the checkpoint of step" in line
    _resume_to_the_end(launcher, run_dir, tmp_path, reference)
