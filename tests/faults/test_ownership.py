"""One live run per directory, and no symlink followed (issue 31, items 1, 2, 8 and 9).

- A disk-tier run is stopped (SIGSTOP) mid-training: a second run on its offload.directory, a
  plain start in its run directory and a `--resume` of it each refuse in one line naming the
  owner's pid (exit 2); the run then continues (SIGCONT) and logs exactly the losses of the same
  run alone. Before: the second run unlinked the first's expert files and both exited 0; the
  resume set the live run's newest checkpoint aside as `.corrupt`.
- The lock is the kernel's (flock): a SIGKILLed owner leaves no stale lock.
- Planted symlinks: at the token cache's `tok-<key>.lock` (its target was truncated), at the
  disk tier's `DISK_DIR/layer000` (the store deleted `expert*.bin` in the target and wrote its
  own), at a run directory's `checkpoints`: refused in one line, the target untouched.
- Temp files of a killed tokeniser (`.tok-<key>.*.tmp`) are removed by the next build of the
  same cache entry; another entry's are left alone.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fault_helpers import losses, tiny_args, wait_for

from moescale.dir_lock import DirectoryInUse, claim_directory
from moescale.train.checkpoint import list_checkpoints

STEPS = 30
DISK = dict(train__steps=str(STEPS), train__checkpoint_interval="5", offload__tier="disk",
            offload__host_cache_bytes="192KiB")


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def _disk_run(corpus: Path, base: Path, name: str, **extra: str) -> list[str]:
    (base / f"{name}-disk").mkdir(parents=True, exist_ok=True)
    return ["train", *tiny_args(corpus, base / name, **DISK,
                                offload__directory=str(base / f"{name}-disk"), **extra)]


@pytest.fixture(scope="module")
def alone(launcher, corpus, tmp_path_factory):
    """The losses of the disk-tier run with nothing else touching its directories."""
    base = tmp_path_factory.mktemp("alone")
    code, text = launcher.run(_disk_run(corpus, base, "run"), base)
    assert code == 0, text
    return losses(base / "run")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_live_runs_directories_are_refused_to_others(launcher, corpus, alone, tmp_path):
    first = launcher.start(_disk_run(corpus, tmp_path, "run"), tmp_path)
    run_dir, disk = tmp_path / "run", tmp_path / "run-disk"
    assert wait_for(lambda: len(losses(run_dir)) >= 7, 60, poll=0.005), first.text()
    os.kill(first.pid, signal.SIGSTOP)      # stopped, alive, still holding both locks
    try:
        saved = list_checkpoints(run_dir / "checkpoints")
        other = _disk_run(corpus, tmp_path, "other", train__seed="7")
        other[other.index("--offload.directory") + 1] = str(disk)
        tries = {"offload.directory": other,
                 "train.run_dir": ["train", *tiny_args(corpus, run_dir, train__steps="3")],
                 "--resume": ["train", "--resume", str(run_dir)]}
        for what, argv in tries.items():
            code, text = launcher.run(argv, tmp_path)
            line = _one_line(text)
            assert code == 2 and f"in use by a live run (pid {first.pid} on " in line, (what, text)
        assert list_checkpoints(run_dir / "checkpoints") == saved   # nothing set aside
        assert not list(run_dir.glob("checkpoints/*.corrupt"))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait() == 0, first.text()
    assert losses(run_dir) == alone                  # bit for bit, as if alone


def _claim_and_hang(directory: str) -> None:
    lock = claim_directory(directory, "test dir", "fix")
    signal.pause()
    lock.release()


@pytest.mark.timeout(60)
def test_the_lock_names_its_owner_and_dies_with_it(tmp_path):
    import multiprocessing

    mine = claim_directory(tmp_path, "dir", "choose another")
    with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()} on .*; choose another"):
        claim_directory(tmp_path, "dir", "choose another")     # another open, same process
    mine.release()
    lock = tmp_path / ".moescale.lock"
    assert not lock.exists()                   # a released claim removes its file
    child = multiprocessing.get_context("fork").Process(target=_claim_and_hang,
                                                         args=(str(tmp_path),))
    child.start()
    assert wait_for(lambda: lock.exists() and lock.read_text().startswith(f"pid {child.pid} "),
                    30, poll=0.01)
    with pytest.raises(DirectoryInUse, match=f"pid {child.pid} "):
        claim_directory(tmp_path, "dir", "fix")
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert lock.read_text().startswith(f"pid {child.pid} ")     # left by the kill: not stale
    claim_directory(tmp_path, "dir", "fix").release()


def _base(corpus: Path, run_dir: Path, cache: Path) -> list[str]:
    return ["train", *tiny_args(corpus, run_dir, train__steps="1",
                                data__cache_dir=str(cache))]


@pytest.mark.timeout(60)
def test_a_link_planted_at_the_cache_lock_is_refused(launcher, corpus, tmp_path):
    cache = tmp_path / "cache"
    code, text = launcher.run(_base(corpus, tmp_path / "first", cache), tmp_path)
    assert code == 0, text
    (lock,) = cache.glob("tok-*.lock")
    for path in cache.iterdir():
        path.unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock.symlink_to(victim)
    code, text = launcher.run(_base(corpus, tmp_path / "second", cache), tmp_path)
    assert code == 2 and "symbolic link" in _one_line(text) and lock.name in text, text
    assert victim.read_text() == "precious\n"


@pytest.mark.timeout(60)
def test_a_link_planted_in_the_disk_tier_directory_is_refused(launcher, corpus, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "expert00000.g0.bin").write_bytes(b"not yours")
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "layer000").symlink_to(target)
    argv = ["train", *tiny_args(corpus, tmp_path / "run", **dict(DISK, train__steps="1"),
                                offload__directory=str(disk))]
    code, text = launcher.run(argv, tmp_path)
    assert code == 2 and "layer000" in _one_line(text) and "symbolic link" in text, text
    assert [p.name for p in target.iterdir()] == ["expert00000.g0.bin"]
    assert (target / "expert00000.g0.bin").read_bytes() == b"not yours"


@pytest.mark.timeout(60)
def test_a_link_planted_in_the_run_directory_is_refused(launcher, corpus, tmp_path):
    run_dir, target = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    target.mkdir()
    (target / "ckpt_00000001.safetensors").write_bytes(b"someone else's")
    (run_dir / "checkpoints").symlink_to(target)
    code, text = launcher.run(["train", *tiny_args(corpus, run_dir, train__steps="2",
                                                   train__keep_last="1")], tmp_path)
    assert code == 2 and "checkpoints" in _one_line(text) and "symbolic link" in text, text
    assert [p.name for p in target.iterdir()] == ["ckpt_00000001.safetensors"]


@pytest.mark.timeout(60)
def test_a_killed_tokenisers_temp_files_are_swept_by_the_next_build(launcher, corpus,
                                                                    tmp_path):
    cache = tmp_path / "cache"
    code, text = launcher.run(_base(corpus, tmp_path / "first", cache), tmp_path)
    assert code == 0, text
    (train_bin,) = cache.glob("tok-*.train.bin")
    stem = train_bin.name[:-len(".train.bin")]
    for path in cache.iterdir():
        path.unlink()
    # what a kill -9 mid-tokenisation leaves: atomic_path's temp files of this entry
    mine = [cache / f".{stem}.train.bin.k3jd93ma.tmp", cache / f".{stem}.val.bin.a8d7eeq1.tmp"]
    theirs = cache / ".tok-00000000000000000000.train.bin.zz99aa11.tmp"   # another entry's
    for path in (*mine, theirs):
        path.write_bytes(b"\0" * 4096)
    code, text = launcher.run(_base(corpus, tmp_path / "second", cache), tmp_path)
    assert code == 0, text
    assert not any(p.exists() for p in mine) and theirs.exists()
    assert train_bin.exists()
