"""The dense half of a checkpoint through DCP (moescale.train.dense_dcp): one process, 2 gloo
ranks replicated, 2 (and 4) gloo ranks sharded with FSDP2's fully_shard; each layout's
checkpoint read by the others (4 sharded ranks by 2). The state read back equals the state
saved bit for bit (gathered whole), and the resumed steps give the uninterrupted run's losses
(bit for bit on the same layout, within the reduction order's 1e-5 on another). A damaged file
is refused naming it; a full disk leaves no temp directory; a kill -9 of both sharded ranks
inside a save leaves the previous checkpoint, which resumes bit for bit."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import resource
import signal

import pytest
import torch
from dcp_workers import build, train, train_on_ranks

from moescale.parallel.launch import run_local
from moescale.train.checkpoint import CheckpointError, remove_unnamed_dense, sweep_temp_files
from moescale.train.dense_dcp import consolidated, save_dense, verify_dense
from moescale.train.named_state import dense_state

SAVE, STEPS = 3, 6


def _ranks(layout: str, directory, save_at=None, resume=None, world=2):
    results = run_local(train_on_ranks, world, (layout, str(directory), STEPS, save_at, resume),
                        timeout_s=30, deadline_s=100)
    losses, entry, rest, state = results[0].value
    return losses, entry, rest, torch.load(io.BytesIO(state))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _sharded_run(tmp_path):
    """2 fully_shard ranks, 6 steps, the dense half saved after step 3; one process reads it."""
    sharded_dir = tmp_path / "sharded"
    sharded_losses, entry, rest, saved = _ranks("sharded", sharded_dir, save_at=SAVE)
    # the sharded checkpoint holds every tensor whole once, as the run had it
    _same(consolidated(sharded_dir, entry), saved)
    assert sorted(p.name for p in (sharded_dir / entry["dir"]).iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]   # every rank its part
    resume = {"entry": entry, "rest": rest, "step": SAVE}
    losses, _, _, loaded = train(0, 1, "one", str(sharded_dir), STEPS, resume=resume)
    _same(loaded, saved)                                    # read back bit for bit
    torch.testing.assert_close(losses, sharded_losses[SAVE:], rtol=1e-5, atol=0)
    return sharded_dir, sharded_losses, resume, saved


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_sharded_checkpoint_resumes_on_one_process(tmp_path):
    _sharded_run(tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_each_layout_resumes_the_others_checkpoint(tmp_path):
    """sharded (2 ranks) -> one process, -> replicated (2 ranks), -> sharded; one process ->
    sharded; the sharded run equals the one-process run."""
    sharded_dir, sharded_losses, resume, saved = _sharded_run(tmp_path)
    one_dir = tmp_path / "one"
    one_losses, one_entry, one_rest, one_saved = train(0, 1, "one", str(one_dir), STEPS, SAVE)
    torch.testing.assert_close(sharded_losses, one_losses, rtol=1e-5, atol=0)
    losses, _, _, loaded = _ranks("replicated", sharded_dir, resume=resume)
    _same(loaded, saved)
    torch.testing.assert_close(losses, sharded_losses[SAVE:], rtol=1e-5, atol=0)
    losses, _, _, loaded = _ranks("sharded", sharded_dir, resume=resume)
    _same(loaded, saved)
    assert losses == sharded_losses[SAVE:]                  # same layout: bit for bit

    resume = {"entry": one_entry, "rest": one_rest, "step": SAVE}
    losses, _, _, loaded = _ranks("sharded", one_dir, resume=resume)
    _same(loaded, one_saved)
    torch.testing.assert_close(losses, one_losses[SAVE:], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_four_rank_sharded_checkpoint_resumes_on_two_sharded_ranks(tmp_path):
    losses4, entry, rest, saved = _ranks("sharded", tmp_path, save_at=SAVE, world=4)
    assert len([p for p in (tmp_path / entry["dir"]).iterdir() if p.suffix == ".distcp"]) == 4
    resume = {"entry": entry, "rest": rest, "step": SAVE}
    losses, _, _, loaded = _ranks("sharded", tmp_path, resume=resume)
    _same(loaded, saved)
    torch.testing.assert_close(losses, losses4[SAVE:], rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_kill9_of_both_ranks_during_a_sharded_save_leaves_the_previous_one(tmp_path):
    """Both fully_shard ranks SIGKILLed inside the save of step 5, their DCP files written:
    the checkpoint of step 3 verifies, the next start's sweep removes the temp directory, and
    resuming sharded from step 3 gives the uninterrupted run's losses bit for bit."""
    reference, _, rest, _ = _ranks("sharded", tmp_path / "reference", save_at=SAVE)
    ckpt = tmp_path / "run" / "checkpoints"
    results = run_local(train_on_ranks, 2, ("sharded", str(ckpt), STEPS, SAVE, None, 5),
                        timeout_s=30, deadline_s=100, raise_on_error=False)
    assert [r.exitcode for r in results] == [-signal.SIGKILL] * 2, results
    temps = [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith("dense-00000005-"), temps
    (done,) = [p.name for p in ckpt.iterdir() if not p.name.endswith(".tmp")]
    entry = {"dir": done, "manifest_sha256": hashlib.sha256(
        (ckpt / done / "manifest.json").read_bytes()).hexdigest()}
    verify_dense(ckpt, entry)
    losses = _ranks("sharded", ckpt, resume={"entry": entry, "rest": rest, "step": SAVE})[0]
    assert losses == reference[SAVE:]
    assert sweep_temp_files(tmp_path / "run")[0] == 2      # the temp, and the unnamed one
    assert not any(ckpt.iterdir())   # (no commit file here names step 3's: a real run's does)


def _one_save(directory):
    model, opt = build("one", 1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    tensors, _ = dense_state(model, opt, set())
    return save_dense(tensors, directory, 7, None), tensors


def test_a_save_is_published_whole_and_verified(tmp_path):
    entry, tensors = _one_save(tmp_path)
    folder = tmp_path / entry["dir"]
    assert [p.name for p in tmp_path.iterdir()] == [entry["dir"]]      # no temp left
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 7 and set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    verify_dense(tmp_path, entry)
    _same(consolidated(tmp_path, entry), {k: v.detach() for k, v in tensors.items()})
    assert consolidated(tmp_path, entry, prefix="model.").keys() == \
        {k for k in tensors if k.startswith("model.")}


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "metadata", "manifest",
                                    "other_dir"])
def test_a_damaged_dense_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    entry, _ = _one_save(tmp_path)
    folder = tmp_path / entry["dir"]
    data = folder / "__0_0.distcp"
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        match = f"{data}'? failed its checksum"
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
        match = f"{data}'? failed its checksum"
    elif damage == "remove":
        data.unlink()
        match = f"{data}'? is missing"
    elif damage == "metadata":
        (folder / ".metadata").write_bytes(b"garbage")
        match = "metadata'? failed its checksum"
    elif damage == "manifest":
        (folder / "manifest.json").write_text("{}")
        match = "manifest.json'? failed its checksum"
    else:
        entry = dict(entry, dir="../elsewhere")
        match = "not one of ours"
    with pytest.raises(CheckpointError, match=match):
        verify_dense(tmp_path, entry)


def test_a_dense_directory_no_commit_names_is_swept(tmp_path):
    entry, _ = _one_save(tmp_path)
    other, _ = _one_save(tmp_path)
    assert remove_unnamed_dense(tmp_path)[0] == 2          # no commit point names either
    assert not any(tmp_path.iterdir())
    assert entry != other


def test_a_write_that_runs_out_of_space_leaves_nothing(tmp_path):
    """A full disk (RLIMIT_FSIZE: writes fail with EFBIG) mid-save: OSError, no temp
    directory left, the checkpoint already written intact."""
    entry, tensors = _one_save(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError) as err:
            save_dense(tensors, tmp_path, 8, None)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.value.errno == errno.EFBIG, err.value
    assert [p.name for p in tmp_path.iterdir()] == [entry["dir"]]
    verify_dense(tmp_path, entry)
