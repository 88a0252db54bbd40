"""ExpertStore on real memory and real files: round trips on the host and disk tiers, a
bounded host cache with schedule-aware eviction and write-back, and clear errors for a missing,
non-directory, read-only or full disk directory."""

import errno
import os

import pytest
import torch

from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

LAYOUT = ExpertLayout([("w1", (3, 4)), ("b", (4,))])  # P = 16 numbers, record = 256 bytes


def masters(e):
    return torch.arange(16, dtype=torch.float32) + 100 * e


def make(tier, tmp_path=None, cache_records=3, **kw):
    cfg = StoreConfig(tier=tier, directory=None if tmp_path is None else str(tmp_path),
                      host_cache_bytes=None if tier == "host" else cache_records * 256, **kw)
    store = ExpertStore(cfg)
    store.add_layer(LAYOUT, 5, masters)
    return store


def roundtrip(store):
    for key in store.keys():
        rec = store.acquire(key)
        assert torch.equal(rec.master_P, masters(key[1]))
        assert LAYOUT.split(rec.master_P)["w1"].shape == (3, 4)
        rec.grad_P.fill_(key[1] + 0.5)
        rec.exp_avg_sq_P.fill_(-1.0)
        store.release(key, dirty=True)
    for key in reversed(list(store.keys())):
        rec = store.acquire(key)
        assert torch.equal(rec.master_P, masters(key[1]))
        assert torch.all(rec.grad_P == key[1] + 0.5) and torch.all(rec.exp_avg_sq_P == -1)
        assert torch.all(rec.exp_avg_P == 0)
        store.release(key)


def test_host_tier_roundtrip():
    store = make("host")
    roundtrip(store)
    store.close()


def test_host_tier_shared_memory():
    store = make("host", shared_memory=True)
    assert store._host[0].is_shared()
    roundtrip(store)


def test_disk_tier_roundtrip_files_and_bounded_cache(tmp_path):
    store = make("disk", tmp_path, cache_records=2)
    files = sorted(p.name for p in (tmp_path / "layer000").iterdir())
    assert files == [f"expert{e:05d}.bin" for e in range(5)]
    assert all(os.path.getsize(tmp_path / "layer000" / f) == 256 for f in files)
    roundtrip(store)
    assert store.peak_cache_bytes <= 2 * 256
    store.close()
    # the files alone hold the state: a raw fp32 [4, P] record per expert
    raw = torch.from_file(str(tmp_path / "layer000" / "expert00003.bin"), size=64,
                          dtype=torch.float32).view(4, 16)
    assert torch.equal(raw[0], masters(3)) and torch.all(raw[1] == 3.5)


def test_schedule_aware_eviction_keeps_what_is_needed_next(tmp_path):
    store = make("disk", tmp_path, cache_records=3)
    for e in (0, 1, 2):
        store.acquire((0, e)), store.release((0, e))
    # backward will touch 2, 1, 0 after 3: LRU would evict 0; the schedule evicts... none
    # needed sooner: 0 is needed last, so it goes first; 1 and 2 stay.
    store.set_upcoming([(0, 3), (0, 2), (0, 1), (0, 0)])
    store.acquire((0, 3)), store.release((0, 3))
    assert set(store._cache) == {(0, 1), (0, 2), (0, 3)}
    read_before = store.bytes_read
    for e in (2, 1):
        store.acquire((0, e)), store.release((0, e))
    assert store.bytes_read == read_before  # hits
    store.close()


def test_prefetch_reads_ahead_without_evicting_sooner_needs(tmp_path):
    store = make("disk", tmp_path, cache_records=2)
    store.set_upcoming([(0, 4), (0, 3), (0, 0)])
    store.prefetch([(0, 4), (0, 3), (0, 0)])
    store.acquire((0, 4)), store.release((0, 4))
    assert set(store._cache) == {(0, 4), (0, 3)}
    store.close()


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make("disk", tmp_path / "nope")


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        make("disk", tmp_path / "file")


def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        target = ro
        if os.geteuid() == 0:  # root ignores permission bits; sysfs refuses new files to all
            if not os.path.isdir("/sys/kernel"):
                pytest.skip("running as root without sysfs: no read-only directory to use")
            target = "/sys/kernel"
        with pytest.raises(ValueError, match="not writable"):
            make("disk", target)
    finally:
        ro.chmod(0o755)


def test_not_enough_free_space_fails_before_writing(tmp_path):
    store = ExpertStore(StoreConfig(tier="disk", directory=str(tmp_path),
                                    host_cache_bytes=1 << 40))
    huge = ExpertLayout([("w", (1 << 20, 1 << 12))])  # 64 GiB per record
    with pytest.raises(OSError) as err:
        store.add_layer(huge, 1 << 10, masters)
    assert err.value.errno == errno.ENOSPC and "free" in str(err.value)
    assert not any(tmp_path.iterdir())


def test_disk_full_during_write_back_is_clear(tmp_path):
    store = make("disk", tmp_path, cache_records=2)
    path = store.path((0, 1))
    os.remove(path)
    os.symlink("/dev/full", path)  # every write to this expert's file hits ENOSPC
    rec = store.acquire((0, 1))
    rec.grad_P.fill_(1.0)
    store.release((0, 1), dirty=True)
    with pytest.raises(OSError) as err:
        store.flush()
    assert err.value.errno == errno.ENOSPC
    assert "disk is full" in str(err.value) and "expert (0, 1)" in str(err.value)


def test_config_errors():
    with pytest.raises(ValueError, match="host_cache_bytes"):
        StoreConfig(tier="disk", directory="/tmp")
    with pytest.raises(ValueError, match="tier"):
        StoreConfig(tier="nvme")


def test_cache_smaller_than_two_records_is_refused(tmp_path):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        make("disk", tmp_path, cache_records=1)


def test_disk_tier_moves_each_record_about_once_per_step(tmp_path):
    """After routing the schedule is known: a training step reads each expert's master once
    for the forward and its record once for backward + step, and writes each record once."""
    import copy as _copy

    from equivalence_models import batches, make_model
    from moescale.offload import OffloadConfig, offload_moe

    model = _copy.deepcopy(make_model())
    record = 4 * 4 * (16 * 32 * 2)
    engine = offload_moe(model, OffloadConfig(tier="disk", directory=str(tmp_path),
                                              host_cache_bytes=3 * record,
                                              device_budget_experts=3))
    opt = torch.optim.AdamW(model.parameters())
    engine.follow(opt)
    store = engine.store
    for step in range(3):
        read0, written0 = store.bytes_read, store.bytes_written
        (idx, tgt), = batches(step, 1)
        model(idx, tgt)[1].backward()
        engine.step()
        opt.step()
        opt.zero_grad()
        engine.synchronize()
        store.flush()
    num = 8  # 2 layers x 4 experts
    assert store.bytes_read - read0 <= num * (record + record // 4)
    assert store.bytes_written - written0 <= num * record
    engine.close()
