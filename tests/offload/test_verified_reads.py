"""Verified disk-tier reads (issue 31, item 3): every read of a record file is checked, chunk by
chunk in the I/O worker, against the xxh3-64 sums the store recorded when it wrote the row.

- A byte flipped in a record file fails the access that reads it with `CorruptReadError` naming
  the layer, expert, row, file and byte offset; every other expert reads fine, and an
  unflipped store reads its values back.
- A partial read (the forward's master row alone, in fp32 and in a compact format whose rows
  have several sizes) is verified; a flip in a row it does not read fails the later access
  that does.
- The copy on write after a checkpoint reads the rows a slot lacks from the linked file: a
  damaged one fails the write-back (and so the next checkpoint) instead of being copied into a
  new file with fresh sums.
- A store filled from a checkpoint (files adopted by hard link) has the manifest's sums: its
  first read is verified too.
- `DirectIO.read` with sums names the byte offset of the damaged chunk of a multi-chunk read;
  `verify_reads=False` turns the check off (the flipped bytes come back).
"""

import os

import pytest
import torch

from moescale.offload.checkpoint import load_store, save_store
from moescale.offload.direct_io import CorruptReadError, DirectIO, SlotPool
from moescale.offload.records import ALL, M, STATE
from moescale.offload.state_format import StateFormat
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

LAYOUT = ExpertLayout([("w1", (31, 32)), ("b", (32,))])  # P = 1024: a fp32 row is 4 KiB
RECORD = 4 * 4096


def masters(e):
    return torch.arange(1024, dtype=torch.float32) + 100 * e


def make(directory, experts=4, state=StateFormat(), **kw):
    store = ExpertStore(StoreConfig(tier="disk", directory=str(directory),
                                    host_cache_bytes=2 * RECORD, state=state, **kw))
    store.add_layer(LAYOUT, experts, masters)
    return store


def flip(path, offset, bit=0x40):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ bit]))


def master_of(store, e):
    rec = store.acquire((0, e), M)
    try:
        return rec.master_P.float().clone()
    finally:
        store.release((0, e))


@pytest.mark.parametrize("state", [StateFormat(), StateFormat(master="bf16", moments="int8")],
                         ids=["fp32", "bf16+int8"])
def test_a_flipped_byte_fails_the_read_naming_expert_file_and_offset(tmp_path, state):
    store = make(tmp_path, state=state)
    try:
        want = [master_of(store, e) for e in range(4)]
        store.drop_cache()
        path = store.path((0, 2))
        flip(path, 403)                          # inside the master row
        with pytest.raises(CorruptReadError) as err:
            master_of(store, 2)                  # the forward's partial read: master alone
        text = str(err.value)
        assert "layer 0 expert 2 (master row)" in text and path in text
        assert "byte offset 0" in text and "\n" not in text
        for e in (0, 1, 3):                      # the others read fine
            assert torch.equal(master_of(store, e), want[e])
    finally:
        store.close()


def test_a_row_not_read_is_checked_when_it_is(tmp_path):
    store = make(tmp_path)
    try:
        offset = store.disk.offset((0, 1), 2)    # exp_avg_sq
        flip(store.path((0, 1)), offset + 17)
        assert torch.equal(master_of(store, 1), masters(1))   # its master is intact
        with pytest.raises(CorruptReadError, match=rf"expert 1 \(exp_avg_sq row\).*byte "
                                                    rf"offset {offset:,}"):
            store.acquire((0, 1), STATE)
        rec = store.acquire((0, 3), ALL)         # another expert, every row
        assert torch.equal(rec.master_P, masters(3)) and torch.all(rec.exp_avg_P == 0)
        store.release((0, 3))
    finally:
        store.close()


def test_the_copy_on_write_never_copies_a_damaged_row(tmp_path):
    """After a checkpoint, the first write of an expert goes to a new file; the rows its slot
    lacks come from the linked file. A damaged one fails the write-back (so the next flush or
    checkpoint), not silently copied under fresh sums."""
    (tmp_path / "store").mkdir(), (tmp_path / "ckpt").mkdir()
    store = make(tmp_path / "store")
    try:
        save_store(store, str(tmp_path / "ckpt"), "1")       # freezes every file
        flip(store.path((0, 0)), store.disk.offset((0, 0), 1) + 5)   # exp_avg, not in the slot
        rec = store.acquire((0, 0), M)
        rec.master_P.add_(1.0)
        store.release((0, 0), dirty=True, rows=M)            # copy on write: reads exp_avg
        with pytest.raises(CorruptReadError, match=r"expert 0 \(exp_avg row\)"):
            store.flush()
        assert os.path.basename(store.path((0, 0))) == "expert00000.g0.bin"   # not replaced
    finally:
        with pytest.raises(CorruptReadError):    # the damaged entry stays dirty: still refused
            store.close()
    assert not (tmp_path / "store" / ".moescale.lock").exists()   # the directory given back


def test_a_store_filled_from_a_checkpoint_verifies_its_first_read(tmp_path):
    for sub in ("a", "b", "ckpt"):
        (tmp_path / sub).mkdir()
    first = make(tmp_path / "a")
    save_store(first, str(tmp_path / "ckpt"), "1")
    first.close()
    store = ExpertStore(StoreConfig(tier="disk", directory=str(tmp_path / "b"),
                                    host_cache_bytes=2 * RECORD))
    store.add_layer(LAYOUT, 4, lambda e: None)     # blank: the checkpoint fills it
    try:
        assert store.origins[(0, 3)] is None     # blank: no run of its own, no tag needed
        load_store(store, str(tmp_path / "ckpt"))
        assert store.disk.sums[(0, 3)] == first.disk.sums[(0, 3)]   # the manifest's
        assert store.origins[(0, 3)] == first.origins[(0, 3)] is not None   # now that run
        assert torch.equal(master_of(store, 1), masters(1))
        store.drop_cache()
        flip(store.path((0, 3)), 4000)           # the adopted file (the checkpoint's link)
        with pytest.raises(CorruptReadError, match=r"layer 0 expert 3 \(master row\)"):
            master_of(store, 3)
    finally:
        store.close()


def test_verification_can_be_turned_off(tmp_path):
    (tmp_path / "s").mkdir(), (tmp_path / "e").mkdir()
    store = make(tmp_path / "s", verify_reads=False)
    try:
        flip(store.path((0, 2)), 3, bit=0x01)
        got = master_of(store, 2)
        assert not torch.equal(got, masters(2))  # read as it is: the flipped bytes
        assert store.disk.io.bytes_verified == 0
    finally:
        store.close()
    from equivalence_models import make_model   # --offload.verify_reads false reaches it
    from moescale.offload import OffloadConfig, offload_moe
    engine = offload_moe(make_model(), OffloadConfig(
        tier="disk", directory=str(tmp_path / "e"), device_budget_experts=2,
        verify_reads=False))
    assert engine.store.disk.verify_reads is False
    engine.close()


def test_direct_io_names_the_damaged_chunk_of_a_multi_chunk_read(tmp_path):
    io = DirectIO(threads=2, chunk_bytes=4096)
    pool = SlotPool(2, 5 * 4096)
    try:
        src = pool.slots[0]
        src.copy_(torch.randint(0, 256, (5 * 4096,), dtype=torch.uint8))
        path = str(tmp_path / "f.bin")
        sums = io.write(path, 8192, src, create=True).result()
        assert len(sums) == 5
        io.read(path, 8192, pool.slots[1], sums).result()       # intact: reads and checks
        assert torch.equal(pool.slots[1], src) and io.bytes_verified == 5 * 4096
        flip(path, 8192 + 3 * 4096 + 11)
        with pytest.raises(CorruptReadError, match=rf"chunk at byte offset {8192 + 3 * 4096:,}"):
            io.read(path, 8192, pool.slots[1], sums, what="the test record").result()
        with pytest.raises(ValueError, match="another chunk size"):
            io.read(path, 8192, pool.slots[1], sums[:4])
    finally:
        io.close()
        pool.close()


def test_xxhash_hashes_without_holding_the_gil():
    """Verification runs in the reader threads; it overlaps Python work only if xxhash
    releases the GIL while it hashes. Measured: a second thread makes calls on 128 MiB while
    the main thread stamps the time in a loop that yields the GIL every turn (switch interval
    10 s: no forced hand-over). Inside a call that holds the GIL (a bytes copy) the main thread
    makes no stamp; inside xxh3_64_intdigest it keeps stamping."""
    import bisect
    import sys
    import threading
    import time

    import xxhash

    data = torch.randint(0, 256, (128 << 20,), dtype=torch.uint8)
    mv = memoryview(data.numpy())

    def stamps_inside(call, reps=4):
        spans, done, stamps = [], threading.Event(), []

        def worker():
            for _ in range(reps):
                start = time.perf_counter()
                call()
                spans.append((start, time.perf_counter()))
            done.set()
        old = sys.getswitchinterval()
        sys.setswitchinterval(10.0)
        try:
            thread = threading.Thread(target=worker)
            thread.start()
            while not done.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0)            # hands the GIL over each turn
            thread.join()
        finally:
            sys.setswitchinterval(old)
        return sum(bisect.bisect_left(stamps, b) - bisect.bisect_right(stamps, a)
                   for a, b in spans)

    assert stamps_inside(lambda: bytes(mv)) == 0        # the method sees a held GIL
    assert stamps_inside(lambda: xxhash.xxh3_64_intdigest(mv)) > 0


def _failed_read_ahead(store, key):
    """Flip a byte of key's master row and let a read-ahead of it fail (kept for its access)."""
    store.drop_cache()
    flip(store.path(key), 10)
    store.set_upcoming([(key, M)])
    entry = store.disk._cache[key]
    with store.disk._lock:                   # the read's callback records its error
        while entry.busy is not None:
            store.disk._changed.wait()
        assert isinstance(entry.error, CorruptReadError)


def test_a_checkpoint_after_a_failed_read_ahead_fails_as_corruption_and_writes_nothing(tmp_path):
    """A read-ahead whose record is never accessed keeps its error; the next checkpoint (the
    library's store checkpoint and the trainer's expert shards) raises it as it is, not as a
    full disk, and leaves nothing behind."""
    from equivalence_models import make_model
    from moescale.expert_state import save_expert_shards
    from moescale.offload import OffloadConfig, offload_moe

    for sub in ("s", "ckpt", "e", "shards"):
        (tmp_path / sub).mkdir()
    store = make(tmp_path / "s")
    _failed_read_ahead(store, (0, 1))
    with pytest.raises(CorruptReadError, match=r"layer 0 expert 1 \(master row\)"):
        save_store(store, str(tmp_path / "ckpt"), "1")
    assert os.listdir(tmp_path / "ckpt") == []
    store.close()

    model = make_model()
    engine = offload_moe(model, OffloadConfig(tier="disk", directory=str(tmp_path / "e"),
                                              host_cache_bytes=3 * 4 * 4 * 1024,
                                              device_budget_experts=2))
    _failed_read_ahead(engine.store, (1, 2))
    with pytest.raises(CorruptReadError, match=r"layer 1 expert 2 \(master row\)"):
        save_expert_shards(model, str(tmp_path / "shards"), rank=0, tag="t", engine=engine)
    assert [p.name for p in (tmp_path / "shards").rglob("*") if p.is_file()] == []
    with pytest.raises(CorruptReadError):   # reported once, not forgotten: read again
        engine.store.acquire((1, 2), M)
    engine.close()
