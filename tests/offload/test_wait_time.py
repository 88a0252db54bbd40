"""wait_s, the seconds compute waits for offloaded experts, measured where it blocks.

Reads made slow for real (test subclasses of the store and of the disk tier that sleep before
reading) grow the device cache's wait by their delay when nothing else hides them; the same
delay hidden under longer compute is not counted (the measure is blocking, not upload time);
the disk tier's reads count for the thread that waits on them only, once."""

from __future__ import annotations

import threading
import time

import torch

from moescale.devices import SimulatedDevice
from moescale.offload.cache import DeviceCache
from moescale.offload.disk_tier import DiskTier
from moescale.offload.optimizer import AdamWConfig, HostOptimizer
from moescale.offload.records import M
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

NUM_EXPERTS = 4
LAYOUT = ExpertLayout([("w", (8, 8))])


class SlowReadStore(ExpertStore):
    """A host-tier store whose master reads (an upload's host side) sleep first."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(StoreConfig(tier="host"))
        self.delay_s = delay_s

    def read_master(self, key):
        time.sleep(self.delay_s)
        return super().read_master(key)


class SlowDiskTier(DiskTier):
    """The disk tier, each acquire delayed by a sleep before its (real) read."""

    delay_s = 0.0

    def acquire(self, key, rows):
        time.sleep(self.delay_s)
        return super().acquire(key, rows)


def _fill(store: ExpertStore) -> ExpertStore:
    store.add_layer(LAYOUT, NUM_EXPERTS, lambda e: torch.full((LAYOUT.numel,), float(e)))
    return store


def _cache(store: ExpertStore, lookahead: int = 1) -> DeviceCache:
    optimizer = HostOptimizer(store, AdamWConfig(), "deferred")
    return DeviceCache(SimulatedDevice(None), store, optimizer, torch.float32,
                       lookahead=lookahead)


def _close(*caches: DeviceCache) -> None:
    for cache in caches:
        cache.optimizer.close()
        cache.device.close()
        cache.store.close()


def _walk(cache: DeviceCache, compute_s: float = 0.0) -> None:
    for e, w_P in cache.walk(0, range(NUM_EXPERTS)):
        assert float(w_P[0]) == e          # the expert asked for
        time.sleep(compute_s)              # the expert's compute


def test_slow_uploads_grow_the_wait_by_their_delay():
    delay = 0.05
    fast, slow = _cache(_fill(SlowReadStore(0.0))), _cache(_fill(SlowReadStore(delay)))
    _walk(fast)
    _walk(slow)
    fast_wait, slow_wait = fast.take_wait_s(), slow.take_wait_s()
    _close(fast, slow)
    # one copy thread: the four sleeps run one after another while compute has nothing to do
    assert slow_wait >= NUM_EXPERTS * delay * 0.95
    assert slow_wait - fast_wait >= NUM_EXPERTS * delay * 0.75
    assert slow.take_wait_s() < 0.01       # taken: the next step starts from zero


def test_uploads_hidden_under_compute_are_not_waits():
    delay = 0.05
    cache = _cache(_fill(SlowReadStore(delay)))
    _walk(cache, compute_s=2 * delay)      # expert i+1 is read while expert i computes
    wait = cache.take_wait_s()
    _close(cache)
    assert wait >= delay * 0.95             # the first expert: nothing to overlap with
    assert wait < 2.5 * delay < NUM_EXPERTS * delay    # the other three were hidden


def test_disk_reads_count_for_the_waiting_thread_once(tmp_path):
    delay = 0.03
    store = ExpertStore(StoreConfig(tier="disk", directory=str(tmp_path),
                                    host_cache_bytes=8 * LAYOUT.record_bytes() + 65536))
    store.disk = SlowDiskTier(str(tmp_path), store.config.host_cache_bytes, 2, False)
    _fill(store)
    cache = _cache(store)
    SlowDiskTier.delay_s = delay
    try:
        _walk(cache)        # the copy thread reads: its sleeps are the walk's stalls
        walk_wait = cache.take_wait_s()
        assert walk_wait >= NUM_EXPERTS * delay * 0.95
        assert store.thread_read_wait_s() == 0.0       # not this thread's reads
        for e in range(2):  # this thread reads (a gradient-norm pass does so)
            store.acquire((0, e), M)
            store.release((0, e))
        assert store.thread_read_wait_s() >= 2 * delay * 0.95
        other = threading.Thread(target=lambda: (store.acquire((0, 3), M),
                                                 store.release((0, 3))))
        other.start()
        other.join()
        outside = cache.take_wait_s()       # another thread's read is not this one's
        assert 2 * delay * 0.95 <= outside < 3 * delay * 0.95 + 0.02
    finally:
        SlowDiskTier.delay_s = 0.0
        _close(cache)
