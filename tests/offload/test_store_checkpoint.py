"""Atomic expert-store checkpoints: a run resumed from a checkpoint (host and disk tiers) gives
the losses of the uninterrupted run; a checkpoint that fails half-way (a read error) leaves the
previous checkpoint and LATEST intact."""

import copy
import os

import pytest
import torch

from equivalence_models import batches, make_model
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.checkpoint import LATEST


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
    dense = copy.deepcopy((model.state_dict(), opt.state_dict()))
    want = run(model, engine, opt, 4, 4)
    engine.close()

    model2, engine2, opt2 = fresh(config("b"))
    engine2.load_checkpoint(str(ckpt))
    model2.load_state_dict(dense[0])
    opt2.load_state_dict(dense[1])
    got = run(model2, engine2, opt2, 4, 4)
    engine2.close()
    assert got == pytest.approx(want, rel=1e-6)


def first_disk_checkpoint(tmp_path):
    """A disk-tier run of one step and its checkpoint "1", with the bytes of every file in it."""
    store_dir, ckpt = tmp_path / "store", tmp_path / "ckpt"
    store_dir.mkdir(), ckpt.mkdir()
    cfg = OffloadConfig(tier="disk", directory=str(store_dir), host_cache_bytes=2 * 4 * 4 * 1024,
                        device_budget_experts=2)
    model, engine, opt = fresh(cfg)
    run(model, engine, opt, 1, 0)
    first = engine.save_checkpoint(str(ckpt), "1")
    return model, engine, opt, ckpt, first, read_files(first)


def read_files(directory):
    return {p: open(os.path.join(directory, p), "rb").read() for p in os.listdir(directory)}


def test_failed_checkpoint_leaves_the_last_one_intact(tmp_path):
    model, engine, opt, ckpt, first, before = first_disk_checkpoint(tmp_path)
    engine.store.drop_cache()  # so that the next save reads the files
    victim = engine.store.path((1, 2))
    with open(victim, "r+b") as f:
        f.truncate(100)  # the next checkpoint fails half-way through reading the store
    with pytest.raises(OSError, match="truncated"):
        engine.save_checkpoint(str(ckpt), "2")
    assert open(ckpt / LATEST).read() == "expert-store-1"
    assert sorted(os.listdir(ckpt)) == sorted([LATEST, "expert-store-1"])
    assert read_files(first) == before
    with pytest.raises(OSError, match="truncated"):  # no half-read entry was left cached
        engine.store.acquire((1, 2))


def test_checkpoint_that_runs_out_of_space_leaves_the_last_one_intact(tmp_path):
    """A write that fails for lack of space (here: RLIMIT_FSIZE, the kernel refusing to grow a
    file past 32 KiB, as a full disk refuses any growth) fails the save with an OSError and
    leaves the previous checkpoint and LATEST exactly as they were."""
    import resource
    import signal

    model, engine, opt, ckpt, first, before = first_disk_checkpoint(tmp_path)
    assert max(len(b) for b in before.values()) > 32 * 1024  # the next save must hit the limit
    run(model, engine, opt, 1, 1)
    engine.synchronize()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, hard))
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
