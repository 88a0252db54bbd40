"""The disk tier of the ExpertStore: one file per expert, a fixed pool of host slots, reads ahead
from the known schedule, write-back behind it, all off the caller's thread and outside the lock.

Record files and slots have the format of records.py; a slot holds any subset of the rows
(`valid`, `dirty` are bit masks over row positions): the forward reads the master row only,
backward the rest; the gradient row, zero between steps, is read and written only while
micro-batches accumulate (`grad_on_disk`).

Scheduling: the store is told the order of coming accesses (`set_upcoming`: (key, rows) in
order; forward order after routing, backward is known from the forward). `_pump` (run on every
change: an access, a release, an I/O completion) keeps up to `max_reads` reads in flight (by
default about two fp32 records' bytes: `records_in_flight`) for the next accesses, taking a free slot or the slot of an entry needed later than the read's
target (Belady's rule), and writes back dirty entries that are not needed again this step
(write-behind), so that the caller waits only when the disk is the bottleneck. Write-backs run
on coordinator threads; the lock is never held across I/O.

Files are versioned (`expert00001.g{n}.bin`): a checkpoint hard-links the current files
(`disk_links.snapshot`), after which the next write of an expert goes to a new file (copy on write, the
rows the slot lacks read from the linked file first), so a checkpoint never copies the state
and never sees a later step. Every write records the xxh3-64 checksum of each chunk of each
row it wrote; `snapshot` hands them to the checkpoint manifest, `adopt` takes them back from one
(both in disk_links.py: the tier's checkpoint half).

Verified reads (`verify_reads`, on by default): every read of a record file, the rows an
access lacks and the rows a copy on write takes from the linked file, goes row by row (a row's
sums start at its own offset, so a partial read such as the forward's master row covers whole
chunks) and each chunk is checked against the sums the store recorded, in the I/O worker that
read it. A mismatch fails the access with `CorruptReadError` naming the layer, expert, row,
file and byte offset; the bytes are never handed out, and a flush (so a checkpoint) raises it
too, so nothing read from a damaged file is trained on or saved.

Deliberately not here: the host tier and the record API (store.py), direct I/O (direct_io.py),
the order of coming accesses (schedule.py), the checkpoint format (checkpoint.py).

Legend: P parameters of one expert.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moescale.offload.direct_io import DirectIO, SlotPool, align_up, gather
from moescale.offload.disk_setup import DiskSetUp
from moescale.offload.disk_writeback import DiskWriteBack
from moescale.offload.records import ALL, POS_GRAD, STATE, G, M, rows_of
from moescale.offload.schedule import AccessSchedule
from moescale.offload.state_format import RecordGeometry, StateFormat
from moescale.offload.stepping import dir_bytes
from moescale.offload.store_types import LOGICAL_POS, ExpertRecord, Key, default_host_cache

ROW_NAMES = ("master", "exp_avg", "exp_avg_sq", "grad")    # by row position (records.py)


@dataclass
class _Entry:
    key: Key
    slot: int
    valid: int = 0
    dirty: int = 0
    pins: int = 0
    busy: Future | None = None     # a read or write in flight on this slot
    evict: bool = False            # give the slot back when the write in flight ends
    error: BaseException | None = None


def records_in_flight(state: StateFormat) -> int:
    """Record reads (and writes) kept in flight by default: two of fp32 state, or as many
    smaller compact records as carry about the same bytes, at most four. Measured past RAM
    (`moescale bench offload-disk --past-ram 1.3`, 2-core machine, 1 GiB host cache): bf16 +
    int8 state 10.9 s per step with four in flight against 12.6 s with two (the disk was
    busy 100% with two; separate runs minutes apart). fp32 keeps the two it always had: one
    run with four took 36.5 s against 27.1 s with two before it, but the disk slowed that
    hour (fp32 with two took 29.4-36.3 s in later runs), so four is not shown to be worse for
    fp32, only not shown to be better."""
    fp32 = StateFormat().state_bytes_per_param()
    return max(2, min(4, round(2 * fp32 / state.state_bytes_per_param())))


class DiskTier(DiskSetUp, DiskWriteBack):
    """Expert records in files, cached in a fixed pool of host slots (thread-safe)."""

    def __init__(self, directory: str, host_cache_bytes: int, io_threads: int = 4,
                 pin_memory: bool = False, max_reads: int | None = None,
                 max_writes: int | None = None,
                 direct_io: bool = True, state: StateFormat = StateFormat(),
                 verify_reads: bool = True, reserve_disk: bool = True) -> None:
        self.directory, self.host_cache_bytes = directory, host_cache_bytes
        self.reserve_disk = reserve_disk     # False: no free-space checks (none written)
        self.verify_reads = verify_reads          # check every read against self.sums
        self.state = state
        self.geometries: list[RecordGeometry] = []    # row offsets per layer
        self.io = DirectIO(io_threads, direct=direct_io)
        max_reads = records_in_flight(state) if max_reads is None else max_reads
        max_writes = records_in_flight(state) if max_writes is None else max_writes
        self._writeback = ThreadPoolExecutor(max_writes, thread_name_prefix="moescale-wb")
        self.pin_memory, self.max_reads, self.max_writes = pin_memory, max_reads, max_writes
        self.numels: list[int] = []               # P per layer
        self.pool: SlotPool | None = None         # made at the first access (all layers known)
        self.slot_rows = ALL     # the leading rows a slot has room for (store.set_slot_rows)
        self._cache: dict[Key, _Entry] = {}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.gen: dict[Key, int] = {}             # file generation of each expert
        self.frozen: set[Key] = set()             # files linked by a checkpoint
        self.grad_on_disk: set[Key] = set()       # the file's gradient row is current
        self.sums: dict[Key, dict[int, list[int]]] = {}   # row position -> chunk xxh3-64s
        self.schedule = AccessSchedule()
        self._reads = self._writes = 0
        self._waiting = 0                         # foreground accesses waiting for a slot
        self.peak_cache_bytes = 0
        self.grad_rows_moved = 0                  # gradient rows read or written (spills)
        self._closed = False                      # close() began: no new I/O
        self.layouts: list = []                   # per layer: its ExpertLayout and count
        self.counts: list[int] = []
        self._need = 0          # bytes of expert files announced (reserve) or written
        self._dir_lock = None   # the directory, owned while open (moescale/dir_lock.py)
        self._waits = threading.local()   # per thread: seconds blocked in acquires

    @classmethod
    def for_store(cls, config) -> "DiskTier":
        """The tier of a StoreConfig(tier='disk')."""
        return cls(config.directory, config.host_cache_bytes or 0, config.io_threads,
                   config.pin_memory, direct_io=config.direct_io, state=config.state,
                   verify_reads=config.verify_reads, reserve_disk=config.reserve_disk)

    # ----------------------------------------------------------------- geometry
    def stride(self, layer: int) -> int:
        """Bytes per row of fp32 records (all four rows alike)."""
        assert self.state.exact, "records of compact state have rows of several sizes"
        return align_up(4 * self.numels[layer])

    def record_bytes(self, layer: int) -> int:
        return self.geometries[layer].total

    def _layer_dir(self, layer: int) -> str:
        return os.path.join(self.directory, f"layer{layer:03d}")

    def path(self, key: Key, gen: int | None = None) -> str:
        gen = self.gen.get(key, 0) if gen is None else gen
        return os.path.join(self._layer_dir(key[0]), f"expert{key[1]:05d}.g{gen}.bin")

    bytes_read = property(lambda self: self.io.bytes_read)
    bytes_written = property(lambda self: self.io.bytes_written)

    def cache_bytes(self) -> int:
        pool = self.pool
        return 0 if pool is None else (len(pool) - pool.num_free) * pool.slot_bytes

    def _ensure_pool(self) -> None:
        if self.pool is not None:
            return
        top = max(rows_of(self.slot_rows)) + 1
        slot_bytes = max(geo.offsets[top] for geo in self.geometries)
        num = self.host_cache_bytes // slot_bytes
        assert num >= 2, "the store checks that the host cache holds two records"
        self.pool = SlotPool(num, slot_bytes, pin=self.pin_memory)

    # ----------------------------------------------------------------- the store's face
    def geometry(self, layer: int) -> RecordGeometry:
        """Where a record's rows lie in its file and slot (4 KiB rows)."""
        return RecordGeometry(self.state, self.numels[layer])

    def record(self, key: Key, rows: int, step_t: torch.Tensor) -> ExpertRecord:
        """The record of key with `rows` loaded, pinned until release (blocks on reads)."""
        self._ensure_cache()
        self._check_rows(rows)
        start = time.perf_counter()
        entry = self.acquire(key, rows)
        self._waits.seconds = self.thread_read_wait_s() + time.perf_counter() - start
        return ExpertRecord(key, [self.row_view(entry, pos) for pos in LOGICAL_POS], step_t)

    def thread_read_wait_s(self) -> float:
        """Seconds the calling thread has spent in acquires (waiting for a cache slot and the
        record's read; a cached record costs microseconds)."""
        return getattr(self._waits, "seconds", 0.0)

    def _check_rows(self, rows: int) -> None:
        if rows & ~self.slot_rows:
            raise ValueError(f"an access of rows {rows:#x}, but the host slots hold rows "
                             f"{self.slot_rows:#x} only (set_slot_rows(records.ALL) first)")

    def _ensure_cache(self) -> None:
        if not self.host_cache_bytes:   # the default: decided once every layer is known
            record = max(self.record_bytes(lay) for lay in range(len(self.numels)))
            self.host_cache_bytes = default_host_cache(
                record, sum(lay.record_bytes(self.state) * n
                            for lay, n in zip(self.layouts, self.counts)))

    def announce(self, accesses, keep=None) -> None:
        """The expected order of the next accesses, (key, rows) each, for eviction and
        read-ahead; pending accesses of the old list for which keep(key) is true (work
        already queued) stay in front."""
        accesses = list(accesses)
        self._ensure_cache()
        for _, rows in accesses:
            self._check_rows(rows)
        kept = [a for a in self.pending_accesses() if keep(a[0])] if keep is not None else []
        self.set_upcoming(kept + accesses)

    def set_slot_rows(self, rows: int, host_cache_bytes: int | None = None) -> None:
        """Size the host slots for a record's leading rows `rows` in `host_cache_bytes`
        (default: as now), after a write-back and drop (ExpertStore.set_slot_rows)."""
        assert rows in (M, STATE, ALL), f"rows={rows:#x}: M, STATE or ALL"
        self.announce([])      # forget the old schedule (and size a default cache)
        cache = self.host_cache_bytes if host_cache_bytes is None else host_cache_bytes
        slot = max(geo.offsets[max(rows_of(rows)) + 1] for geo in self.geometries)
        if cache < 2 * slot:
            raise ValueError(f"host_cache_bytes={cache} holds fewer than two slots of {slot} "
                             f"bytes; raise it to at least {2 * slot}")
        self.flush(drop=True)
        assert not self.cache_bytes(), "set_slot_rows while expert records are acquired"
        self.pool.close()
        self.pool, self.slot_rows, self.host_cache_bytes = None, rows, cache

    def host_bytes(self) -> int:
        """Records held in RAM between accesses: none (the slots are the cache's)."""
        return 0

    def memory(self) -> dict:
        """Its files' bytes and the bytes read and written so far."""
        return {"disk_bytes": dir_bytes(self.directory), "disk_read_bytes": int(self.bytes_read),
                "disk_written_bytes": int(self.bytes_written)}

    # ----------------------------------------------------------------- views
    def row_view(self, entry: _Entry, pos: int) -> torch.Tensor:
        """Row `pos` in the entry's slot, as its format keeps it (fp32 [P] for fp32 state)."""
        return self.geometries[entry.key[0]].typed(self.pool.slots[entry.slot], pos)

    def _span(self, entry: _Entry, first: int, count: int) -> torch.Tensor:
        start, stop = self.geometries[entry.key[0]].span(first, count)
        return self.pool.slots[entry.slot][start:stop]

    def offset(self, key: Key, pos: int) -> int:
        return self.geometries[key[0]].offsets[pos]

    # ----------------------------------------------------------------- schedule
    def set_upcoming(self, accesses: list[tuple[Key, int]]) -> None:
        self._ensure_pool()
        with self._lock:
            self.schedule.set(accesses)
            self._pump()

    def skip(self, key: Key) -> None:
        """An access of key in the schedule will not happen (a device copy was reused)."""
        with self._lock:
            self.schedule.consume(key)
            self._pump()

    def pending_accesses(self) -> list[tuple[Key, int]]:
        with self._lock:
            return self.schedule.pending()

    # ----------------------------------------------------------------- access
    def acquire(self, key: Key, rows: int) -> _Entry:
        """The entry of key with `rows` valid, pinned until release (blocks on reads)."""
        self._ensure_pool()
        with self._lock:
            self.schedule.consume(key)
            if key in self._cache:      # recency order: of the entries no schedule names, the
                self._cache[key] = self._cache.pop(key)     # least recently used goes first
            while True:
                entry = self._cache.get(key)
                if entry is None:
                    slot = self._free_slot(self.schedule.next_use(key), foreground=True)
                    if slot is None:
                        self._waiting += 1     # prefetch leaves freed slots to us
                        self._changed.wait()
                        self._waiting -= 1
                        continue
                    entry = self._cache[key] = _Entry(key, slot)
                    self._peak()
                if entry.busy is None and entry.error is not None:
                    error, entry.error = entry.error, None
                    self._drop_if_idle(entry)
                    raise error
                if entry.busy is None and not self._start_read(entry, rows):
                    entry.pins += 1
                    self._pump()
                    return entry
                entry.pins += 1     # keep it while waiting outside the lock
                busy = entry.busy
                self._lock.release()
                try:
                    try:
                        busy.result()
                    except BaseException:
                        pass        # recorded on the entry by the callback
                finally:
                    self._lock.acquire()
                    entry.pins -= 1

    def release(self, key: Key, dirty: int = 0, grad_zero: bool = False) -> None:
        with self._lock:
            entry = self._cache[key]
            assert entry.pins > 0, f"release of {key} that is not acquired"
            entry.pins -= 1
            entry.dirty |= dirty
            if grad_zero:   # the accumulator was zeroed by a step: nothing to persist
                entry.dirty &= ~G
                self.grad_on_disk.discard(key)
                self.sums[key].pop(POS_GRAD, None)
            self._changed.notify_all()
            self._pump()

    def _start_read(self, entry: _Entry, rows: int) -> bool:
        """Start reading the rows of `rows` the entry lacks (lock held); False if none."""
        assert not rows & ~self.slot_rows, f"rows {rows:#x}; slots hold {self.slot_rows:#x}"
        missing = rows & ~entry.valid
        if missing & G and entry.key not in self.grad_on_disk:
            self.row_view(entry, POS_GRAD).zero_()     # a zero accumulator is never read
            entry.valid |= G
            missing &= ~G
        if not missing:
            return False
        self.grad_rows_moved += bool(missing & G)
        futures = self._read_rows(entry, self.path(entry.key), self._expected(entry.key, missing))
        self._reads += 1
        entry.busy = futures[0] if len(futures) == 1 else gather(futures)
        entry.busy.add_done_callback(lambda f, e=entry, m=missing: self._read_done(e, m, f))
        return True

    def _expected(self, key: Key, rows: int) -> dict[int, list[int] | None]:
        """Per row position of `rows`, the chunk sums its read must match (lock held; None
        each when reads are not verified)."""
        if not self.verify_reads:
            return dict.fromkeys(rows_of(rows))
        known = self.sums[key]
        assert all(p in known for p in rows_of(rows)), \
            f"no checksum recorded for rows {rows:#x} of {key} (has {sorted(known)})"
        return {p: known[p] for p in rows_of(rows)}

    def _read_rows(self, entry: _Entry, path: str, sums: dict[int, list[int] | None]
                   ) -> list[Future]:
        """Read each row of `sums` from path into the entry's slot, its chunks checked against
        the sums (None: unchecked) by the workers."""
        layer, e = entry.key
        return [self.io.read(path, self.offset(entry.key, p), self._span(entry, p, 1), expect,
                             f"layer {layer} expert {e} ({ROW_NAMES[p]} row)")
                for p, expect in sums.items()]

    def _read_done(self, entry: _Entry, rows: int, future: Future) -> None:
        with self._lock:
            self._reads -= 1
            entry.busy = None
            if future.exception() is not None:
                entry.error = future.exception()
            else:
                entry.valid |= rows
            self._changed.notify_all()
            self._pump()

    # ----------------------------------------------------------------- slots and eviction
    def _free_slot(self, position: float, foreground: bool) -> int | None:
        """A slot for a read targeting `position` (lock held): a free one, or that of the
        idle, unpinned entry used farthest in the future (if later than position; any for a
        foreground access). A dirty victim's write-back is started and None returned."""
        slot = self.pool.take()
        if slot is not None:
            return slot
        victim, victim_use, failed = None, -1.0, None
        for entry in self._cache.values():
            if entry.pins or entry.busy is not None:
                continue
            if entry.error is not None:
                failed = entry
                continue
            use = self.schedule.next_use(entry.key)
            if use > victim_use:
                victim, victim_use = entry, use
        if victim is None and failed is not None and foreground:
            error, failed.error = failed.error, None   # e.g. a write-back that hit a full disk
            raise error
        if victim is None or (not foreground and victim_use <= position):
            return None
        if victim.dirty:
            if self._writes < self.max_writes or foreground:
                self._start_write(victim, evict=True)
            return None
        del self._cache[victim.key]
        return victim.slot

    def _drop_if_idle(self, entry: _Entry) -> None:
        if not entry.pins and entry.busy is None and not entry.dirty:
            del self._cache[entry.key]
            self.pool.give(entry.slot)

    def _peak(self) -> None:
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes())

    def _pump(self) -> None:
        """Issue reads for the next accesses and write-behind of finished entries (lock held)."""
        if self.pool is None or self._closed:
            return
        for entry in list(self._cache.values()):
            if self._writes >= self.max_writes:
                break
            if entry.dirty and not entry.pins and entry.busy is None and \
                    entry.error is None and self.schedule.next_use(entry.key) == math.inf:
                self._start_write(entry, evict=False)
        for i, key, rows in self.schedule.first_uses():
            if self._reads >= self.max_reads:
                break
            entry = self._cache.get(key)
            if entry is not None:
                if entry.busy is None and entry.error is None:
                    self._start_read(entry, rows)
                continue
            slot = None if self._waiting else self._free_slot(i, foreground=False)
            if slot is None:
                break
            entry = self._cache[key] = _Entry(key, slot)
            self._peak()
            self._start_read(entry, rows)

    def close(self) -> None:
        """Write back and stop; after a failed flush (a damaged file, a full disk) the reads
        and writes still in flight finish first and nothing new starts."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                while any(e.busy is not None for e in self._cache.values()):
                    self._changed.wait()
            try:
                self._writeback.shutdown(wait=True)
                self.io.close()
                if self.pool is not None:
                    self.pool.close()
            finally:     # a failed last write-back still gives the directory back
                self.release_directory()


