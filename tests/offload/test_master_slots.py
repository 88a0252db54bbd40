"""The disk tier's host slots sized for master rows alone (`ExpertStore.set_slot_rows`, what
generation uses), on real files: the same bytes cache four times the fp32 experts and serve
them without a read; what was dirty is written back before the slots change; other rows are
refused while they last and whole records work again after; too few slots are refused; of the
cached experts no schedule names, the least recently used is evicted first; a store that writes
nothing (`reserve_disk=False`) makes sparse files past the free disk."""

import pytest
import torch

from moescale.offload.records import ALL, M, STATE
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

LAYOUT = ExpertLayout([("w1", (31, 32)), ("b", (32,))])  # P = 1024: a row is 4 KiB
ROW = 4096
pytestmark = pytest.mark.timeout(60)


def masters(e):
    return torch.arange(1024, dtype=torch.float32) + 100 * e


def make(tmp_path, experts=8, cache_bytes=2 * 4 * ROW):
    store = ExpertStore(StoreConfig(tier="disk", directory=str(tmp_path),
                                    host_cache_bytes=cache_bytes))
    store.add_layer(LAYOUT, experts, masters)
    return store


def read_all(store, experts) -> int:
    """Read every expert's master (checking it); the bytes that took from the files."""
    before = store.bytes_read
    for e in experts:
        rec = store.acquire((0, e), M)
        assert torch.equal(rec.master_P, masters(e) + (0.5 if e == 3 else 0))
        store.release((0, e))
    return store.bytes_read - before


def test_master_slots_cache_four_times_the_experts_in_the_same_bytes(tmp_path):
    store = make(tmp_path)                         # two whole records' bytes
    rec = store.acquire((0, 3), ALL)
    rec.master_P.add_(0.5)                         # dirty: written back before the change
    store.release((0, 3), dirty=True)
    read_all(store, range(8))
    assert read_all(store, range(8)) == 8 * ROW       # two record slots: no hit
    store.set_slot_rows(M)
    assert store.cache_bytes() == 0
    assert read_all(store, range(8)) == 8 * ROW    # cold once, then all eight are cached
    assert read_all(store, range(8)) == 0 and store.cache_bytes() == 8 * ROW
    with pytest.raises(ValueError, match="host slots hold rows 0x1 only"):
        store.acquire((0, 1), STATE)
    with pytest.raises(ValueError, match="host slots hold rows 0x1 only"):
        store.set_upcoming([((0, 1), ALL)])
    store.set_slot_rows(ALL)                       # whole records again
    rec = store.acquire((0, 5), ALL)
    assert torch.equal(rec.master_P, masters(5)) and torch.all(rec.exp_avg_P == 0)
    rec.exp_avg_P.fill_(2.0)
    store.release((0, 5), dirty=True)
    store.drop_cache()
    rec = store.acquire((0, 5), STATE)
    assert torch.all(rec.exp_avg_P == 2.0)
    store.release((0, 5))
    store.close()


def test_too_few_slots_and_a_held_record_are_refused(tmp_path):
    store = make(tmp_path)
    with pytest.raises(ValueError, match="fewer than two slots of 4096 bytes; raise it to at "
                                         "least 8192"):
        store.set_slot_rows(M, host_cache_bytes=ROW)
    store.acquire((0, 0), M)
    with pytest.raises(AssertionError, match="acquired"):
        store.set_slot_rows(M)
    store.release((0, 0))
    store.close()


def test_the_least_recently_used_unscheduled_expert_is_evicted_first(tmp_path):
    store = make(tmp_path)
    store.set_slot_rows(M, host_cache_bytes=3 * ROW)     # three masters
    read_all(store, [0, 1, 2])
    assert read_all(store, [0]) == 0                      # 0 is now the most recent
    assert read_all(store, [4]) == ROW                    # evicts 1, the least recent
    assert read_all(store, [0, 2]) == 0 and read_all(store, [1]) == ROW
    store.close()


def test_a_store_that_writes_nothing_skips_the_free_space_check(tmp_path):
    """reserve_disk=False (generation's store, whose files a checkpoint's replace by hard link):
    sparse files larger than the free disk are made; the default refuses them up front."""
    import shutil

    big = ExpertLayout([("w", (1 << 10, 1 << 12))])       # 16 MiB rows, 48 MiB that persist
    experts = 2 * shutil.disk_usage(tmp_path).free // (48 << 20)   # twice the free disk
    for reserve in (True, False):
        directory = tmp_path / str(reserve)
        directory.mkdir()
        store = ExpertStore(StoreConfig(tier="disk", directory=str(directory),
                                        host_cache_bytes=1 << 50, reserve_disk=reserve))
        if reserve:
            with pytest.raises(OSError, match="the disk tier needs"):
                store.add_layer(big, experts, lambda e: None)
        else:
            store.add_layer(big, experts, lambda e: None)     # no slot is made before an access
            assert sum(f.stat().st_blocks for f in directory.rglob("*.bin")) == 0
        store.close()
