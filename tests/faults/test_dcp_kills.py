"""kill -9 inside a save of the dense half through DCP (moescale/train/dense_dcp.py).

The random kills of test_kills_and_signals.py land while the dense half's DCP temp directory
or the commit file's temp is written; these tests kill at the two moments in between, exactly
(kill_loop.die_at: the process SIGKILLs itself there):

- "publish": every rank's DCP files are written, no manifest yet, the directory still `*.tmp`;
- "commit": the dense directory is renamed into place, the commit file not yet written (a
  directory no commit point names).

Each leaves the previous checkpoint as the newest; the next start removes what the kill left
(one line), `--resume` gives the uninterrupted run's losses bit for bit, and afterwards every
dense directory is named by a commit point. The same on 2 ranks (each writes its part of the
dense half): both killed at the moment, or only rank 1 (rank 0's next collective then fails
with the backend's error and it removes the temp directory on its way out).

A bit flipped in a DCP data file of the newest checkpoint: `--resume` names the file, falls back
to the previous checkpoint and continues with the uninterrupted run's losses.
"""

from __future__ import annotations

from functools import partial

import pytest
from fault_helpers import losses, rank_env, temp_files
from kill_loop import STEPS, die_at, loop_args

from moescale.parallel.launch import free_port
from moescale.train.checkpoint import (DENSE_DIR, dense_dirs_named, list_checkpoints,
                                       load_checkpoint)

KILL_STEP = 5


def _left_clean(run_dir) -> None:
    """No temp file, and every dense directory named by a commit point."""
    ckpt = run_dir / "checkpoints"
    assert temp_files(run_dir) == []
    dense = {p.name for p in ckpt.iterdir() if DENSE_DIR.fullmatch(p.name)}
    assert dense == dense_dirs_named(ckpt)[0] and len(dense) == len(list_checkpoints(ckpt))


def _after_kill(run_dir, where: str, survivor: bool = False) -> None:
    """The previous checkpoint is the newest; the kill left its temp or unnamed directory (a
    surviving rank 0 removes the temp directory when its collective fails)."""
    ckpt = run_dir / "checkpoints"
    assert list_checkpoints(ckpt)[-1][0] == KILL_STEP - 1
    ours = [p.name for p in ckpt.iterdir() if p.name.startswith(f"dense-{KILL_STEP:08d}-")]
    if survivor:
        assert ours == [], ours
        return
    assert len(ours) == 1 and ours[0].endswith(".tmp") == (where == "publish"), ours


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["publish", "commit"])
def test_kill9_inside_a_dcp_save_resumes_bitwise(launcher, corpus, reference, tmp_path, where):
    run_dir = tmp_path / "run"
    child = launcher.start(loop_args(corpus, run_dir, STEPS), tmp_path,
                           hook=partial(die_at, where, KILL_STEP))
    assert child.wait() == -9, child.text()
    _after_kill(run_dir, where)
    code, text = launcher.run(["train", "--resume", str(run_dir)], tmp_path)
    assert code == 0, text
    assert "temp file(s)" in text and f"(step {KILL_STEP - 1})" in text
    assert losses(run_dir) == reference
    _left_clean(run_dir)


def _two_ranks(launcher, tmp_path, argv, hooks=(None, None), name="run"):
    port = free_port()
    return [launcher.start(argv, tmp_path, log=tmp_path / f"{name}-rank{r}.log",
                           env=rank_env(r, 2, port), hook=hooks[r]) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("who", ["both", "rank1"])
def test_kill9_of_ranks_inside_a_dcp_save_resumes_bitwise(launcher, corpus, tmp_path, who):
    steps = 10
    fresh = lambda run_dir: loop_args(corpus, run_dir, steps,    # noqa: E731
                                      parallel__timeout_s="10")
    reference = tmp_path / "reference"
    for child in _two_ranks(launcher, tmp_path, fresh(reference), name="reference"):
        assert child.wait() == 0, child.text()
    run_dir = tmp_path / "run"
    hook = partial(die_at, "publish", KILL_STEP)
    children = _two_ranks(launcher, tmp_path, fresh(run_dir),
                          (hook if who == "both" else None, hook))
    codes = [child.wait() for child in children]
    assert codes[1] == -9 and (codes[0] == -9 if who == "both" else codes[0] not in (0, -9)), \
        [c.text()[-2000:] for c in children]
    _after_kill(run_dir, "publish", survivor=who == "rank1")
    resumed = _two_ranks(launcher, tmp_path, ["train", "--resume", str(run_dir)], name="resume")
    for child in resumed:
        assert child.wait() == 0, child.text()
    assert ("temp file(s)" in resumed[0].text()) == (who == "both")
    assert losses(run_dir) == losses(reference)
    _left_clean(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_corrupted_dcp_file_is_refused_by_name_and_resume_falls_back(launcher, corpus,
                                                                      reference, tmp_path):
    run_dir = tmp_path / "run"
    code, text = launcher.run(loop_args(corpus, run_dir, STEPS), tmp_path)
    assert code == 0, text
    ckpt = run_dir / "checkpoints"
    newest = load_checkpoint(list_checkpoints(ckpt)[-1][1])[1]
    data = ckpt / newest["dense"]["dir"] / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01                       # one bit of one tensor
    data.write_bytes(bytes(raw))
    code, text = launcher.run(["train", "--resume", str(run_dir)], tmp_path)
    assert code == 0, text
    assert f"dense checkpoint file {str(data)!r} failed its checksum" in text
    assert f"(step {STEPS - 1})" in text                  # the previous checkpoint
    assert losses(run_dir) == reference
