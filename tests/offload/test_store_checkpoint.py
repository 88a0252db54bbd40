"""Atomic, verified expert-store checkpoints: a run resumed from a checkpoint (host and disk
tiers) gives the losses of the uninterrupted run; a disk-tier checkpoint hard-links the store's
files and later steps never touch them; every kind of corruption (a flipped bit, a block of
0xFF, an edited step count, a missing or truncated file, LATEST pointing elsewhere, no
manifest) is refused as corruption and loads nothing; a checkpoint that fails half-way (no
space, a damaged source file) leaves the previous checkpoint and LATEST intact."""

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from equivalence_models import batches, make_model
from moescale.models.resident import dense_state_dict
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.checkpoint import LATEST, StoreCheckpointError


def run(model, engine, opt, steps, start):
    losses = []
    for step in range(start, start + steps):
        (idx, tgt), = batches(step, 1)
        _, loss = model(idx, tgt)
        loss.backward()
        engine.step()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine.synchronize()
    return losses


def fresh(config):
    model = copy.deepcopy(make_model())
    engine = offload_moe(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    engine.follow(opt)
    return model, engine, opt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_resume_gives_the_uninterrupted_losses(tmp_path, tier):
    def config(sub):
        if tier == "host":
            return OffloadConfig(device_budget_experts=2)
        (tmp_path / sub).mkdir()
        return OffloadConfig(tier="disk", directory=str(tmp_path / sub),
                             host_cache_bytes=3 * 4 * 4 * 1024, device_budget_experts=2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    model, engine, opt = fresh(config("a"))
    run(model, engine, opt, 4, 0)
    engine.save_checkpoint(str(ckpt), "00000004")
    dense = copy.deepcopy((dense_state_dict(model), opt.state_dict()))   # experts: the store's
    want = run(model, engine, opt, 4, 4)
    engine.close()

    model2, engine2, opt2 = fresh(config("b"))
    engine2.load_checkpoint(str(ckpt))
    model2.load_state_dict(dense[0])
    opt2.load_state_dict(dense[1])
    got = run(model2, engine2, opt2, 4, 4)
    engine2.close()
    assert got == pytest.approx(want, rel=1e-6)


def first_disk_checkpoint(tmp_path, ckpt=None):
    """A disk-tier run of one step and its checkpoint "1", with the bytes of every file in it."""
    store_dir, ckpt = tmp_path / "store", ckpt or tmp_path / "ckpt"
    store_dir.mkdir(), ckpt.mkdir(exist_ok=True)
    cfg = OffloadConfig(tier="disk", directory=str(store_dir), host_cache_bytes=2 * 4 * 4 * 1024,
                        device_budget_experts=2)
    model, engine, opt = fresh(cfg)
    run(model, engine, opt, 1, 0)
    first = engine.save_checkpoint(str(ckpt), "1")
    return model, engine, opt, ckpt, first, read_files(first)


def read_files(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, directory)] = open(path, "rb").read()
    return out


def test_disk_checkpoint_links_the_store_files_and_training_never_touches_them(tmp_path):
    """A disk-tier checkpoint costs no copy (its record files are the store's, hard-linked);
    the steps after it write new files (copy on write), so the checkpoint stays as saved and
    a resume from it adopts the files by link again."""
    model, engine, opt, ckpt, first, before = first_disk_checkpoint(tmp_path)
    record = os.path.join(first, "layer001", "expert00002.bin")
    assert os.stat(record).st_nlink == 2   # the checkpoint's link and the store's
    written0 = engine.store.bytes_written
    engine.save_checkpoint(str(ckpt), "1b")   # nothing changed: no byte written
    assert engine.store.bytes_written == written0
    first = os.path.join(ckpt, open(ckpt / LATEST).read())
    before = read_files(first)
    run(model, engine, opt, 3, 1)
    engine.store.flush()
    assert read_files(first) == before
    engine.close()
    (tmp_path / "store2").mkdir()
    model2, engine2, opt2 = fresh(OffloadConfig(
        tier="disk", directory=str(tmp_path / "store2"), host_cache_bytes=2 * 4 * 4 * 1024,
        device_budget_experts=2))
    written0 = engine2.store.bytes_written
    engine2.load_checkpoint(str(ckpt))
    assert engine2.store.bytes_written == written0 and read_files(first) == before
    run(model2, engine2, opt2, 2, 1)   # training on writes new files
    engine2.store.flush()
    assert read_files(first) == before
    engine2.close()


def corrupt_cases():
    def flip_bit(first):   # one exponent bit of one master weight
        path = os.path.join(first, "layer001", "expert00002.bin")
        data = bytearray(open(path, "rb").read())
        data[403] ^= 0x40
        open(path, "wb").write(bytes(data))

    def ff_block(first):
        path = os.path.join(first, "layer000", "expert00001.bin")
        with open(path, "r+b") as f:
            f.seek(4096)
            f.write(b"\xff" * 8192)

    def edit_step(first):
        path = os.path.join(first, "manifest.json")
        text = open(path).read().replace('"step": 1.0', '"step": 7.0', 1)
        open(path, "w").write(text)

    def missing_file(first):
        os.remove(os.path.join(first, "layer000", "expert00003.bin"))

    def truncated(first):
        os.truncate(os.path.join(first, "layer000", "expert00000.bin"), 100)

    def latest_elsewhere(first):
        other = os.path.join(os.path.dirname(os.path.dirname(first)), "other-run")
        shutil.copytree(first, other)
        open(os.path.join(os.path.dirname(first), LATEST), "w").write(other)

    def latest_missing_store(first):
        open(os.path.join(os.path.dirname(first), LATEST), "w").write("expert-store-0")

    def no_manifest(first):
        os.remove(os.path.join(first, "manifest.json"))

    return dict(flip_bit=flip_bit, ff_block=ff_block, edit_step=edit_step,
                missing_file=missing_file, truncated=truncated,
                latest_elsewhere=latest_elsewhere, latest_missing_store=latest_missing_store,
                no_manifest=no_manifest)


@pytest.mark.parametrize("case", sorted(corrupt_cases()))
def test_corrupt_store_checkpoints_are_refused_and_change_nothing(tmp_path, case):
    model, engine, opt, ckpt, first, before = first_disk_checkpoint(tmp_path)
    engine.close()
    (tmp_path / "fresh").mkdir()
    model2, engine2, opt2 = fresh(OffloadConfig(
        tier="disk", directory=str(tmp_path / "fresh"), host_cache_bytes=2 * 4 * 4 * 1024,
        device_budget_experts=2))
    masters = [engine2.store.read_record(k)[0][0].clone() for k in engine2.store.keys()]
    corrupt_cases()[case](first)
    with pytest.raises(StoreCheckpointError) as err:
        engine2.load_checkpoint(str(ckpt))
    assert "corrupt" in str(err.value) or "missing" in str(err.value)
    assert "\n" not in str(err.value)
    after = [engine2.store.read_record(k)[0][0] for k in engine2.store.keys()]
    assert all(torch.equal(a, b) for a, b in zip(masters, after))   # nothing was loaded
    engine2.close()


def host_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    model, engine, opt = fresh(OffloadConfig(device_budget_experts=2))
    run(model, engine, opt, 1, 0)
    first = engine.save_checkpoint(str(ckpt), "1")
    return model, engine, opt, ckpt, first, read_files(first)


def test_checkpoint_that_runs_out_of_space_leaves_the_last_one_intact(tmp_path):
    """A write that fails for lack of space (here: RLIMIT_FSIZE, the kernel refusing to grow a
    file past 8 KiB, as a full disk refuses any growth) fails the save with an OSError and
    leaves the previous checkpoint and LATEST exactly as they were, and no debris."""
    import resource
    import signal

    model, engine, opt, ckpt, first, before = host_checkpoint(tmp_path)
    assert max(len(b) for b in before.values()) > 8 * 1024  # the next save must hit the limit
    run(model, engine, opt, 1, 1)
    engine.synchronize()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, hard))
    try:
        with pytest.raises(OSError, match="previous checkpoint is intact"):
            engine.save_checkpoint(str(ckpt), "2")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert open(ckpt / LATEST).read() == "expert-store-1"
    assert sorted(os.listdir(ckpt)) == sorted([LATEST, "expert-store-1"])
    assert read_files(first) == before
    engine.close()


def test_copy_to_another_filesystem_refuses_a_damaged_store_file(tmp_path):
    """Across filesystems the records are copied and checked against the checksums the store
    wrote: a file damaged under the store fails the save, the last checkpoint intact."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        if os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is on the test directory's filesystem")
        model, engine, opt, ckpt, first, before = first_disk_checkpoint(tmp_path, Path(shm))
        run(model, engine, opt, 1, 1)
        engine.store.drop_cache()
        with open(engine.store.path((1, 2)), "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 8)
        with pytest.raises(OSError, match="previous checkpoint is intact"):
            engine.save_checkpoint(shm, "2")
        assert open(os.path.join(shm, LATEST)).read() == "expert-store-1"
        assert sorted(os.listdir(shm)) == sorted([LATEST, "expert-store-1"])
        assert read_files(first) == before
