"""The disk tier of the ExpertStore: one file per expert, a fixed pool of host slots, reads ahead
from the known schedule, write-back behind it, all off the caller's thread and outside the lock.

Record files and slots have the format of records.py; a slot holds any subset of the rows
(`valid`, `dirty` are bit masks over row positions): the forward reads the master row only,
backward the rest; the gradient row, zero between steps, is read and written only while
micro-batches accumulate (`grad_on_disk`).

Scheduling: the store is told the order of coming accesses (`set_upcoming`: (key, rows) in
order; forward order after routing, backward is known from the forward). `_pump` (run on every
change: an access, a release, an I/O completion) keeps up to `max_reads` reads in flight for
the next accesses, taking a free slot or the slot of an entry needed later than the read's
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moescale.offload.direct_io import DirectIO, SlotPool, align_up, gather
from moescale.offload.record_files import write_layer_files
from moescale.offload.records import ALL, POS_GRAD, STATE, G, rows_of
from moescale.offload.schedule import AccessSchedule
from moescale.offload.state_format import RecordGeometry, StateFormat

Key = tuple[int, int]
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


class DiskTier:
    """Expert records in files, cached in a fixed pool of host slots (thread-safe)."""

    def __init__(self, directory: str, host_cache_bytes: int, io_threads: int = 4,
                 pin_memory: bool = False, max_reads: int = 2, max_writes: int = 2,
                 direct_io: bool = True, state: StateFormat = StateFormat(),
                 verify_reads: bool = True) -> None:
        self.directory, self.host_cache_bytes = directory, host_cache_bytes
        self.verify_reads = verify_reads          # check every read against self.sums
        self.state = state
        self.geometries: list[RecordGeometry] = []    # row offsets per layer
        self.io = DirectIO(io_threads, direct=direct_io)
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

    # ----------------------------------------------------------------- set-up
    def register_layer(self, numel: int) -> int:
        """Know a layer of experts of numel parameters (its files are written elsewhere)."""
        self.numels.append(numel)
        self.geometries.append(RecordGeometry(self.state, numel))
        return len(self.numels) - 1

    def add_layer(self, numel: int, num_experts: int, init) -> None:
        """Write the layer's files (record_files.py: init(e) as the master, None: zero and
        unwritten; zero moments as a sparse tail; a previous run's files unlinked first)."""
        layer = self.register_layer(numel)
        for e, sums in enumerate(write_layer_files(
                self.io, self._layer_dir(layer), lambda e: self.path((layer, e), 0),
                self.geometries[layer], num_experts, init)):
            self.sums[(layer, e)] = sums
            self.gen[(layer, e)] = 0

    def _ensure_pool(self) -> None:
        if self.pool is not None:
            return
        top = max(rows_of(self.slot_rows)) + 1
        slot_bytes = max(geo.offsets[top] for geo in self.geometries)
        num = self.host_cache_bytes // slot_bytes
        assert num >= 2, "the store checks that the host cache holds two records"
        self.pool = SlotPool(num, slot_bytes, pin=self.pin_memory)

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

    # ----------------------------------------------------------------- write-back
    def _start_write(self, entry: _Entry, evict: bool) -> None:
        """Write the entry's dirty rows on a coordinator thread (lock held)."""
        key = entry.key
        cow = key in self.frozen
        rows = entry.dirty
        if cow:   # a new file holds everything that persists; the old one stays linked
            rows |= STATE | (G if key in self.grad_on_disk or entry.dirty & G else 0)
        need = rows & ~entry.valid
        old_path = self.path(key)
        new_gen = self.gen[key] + 1 if cow else self.gen[key]
        try:
            busy = self._writeback.submit(self._write_rows, entry, rows, self._expected(key, need),
                                          old_path, self.path(key, new_gen), cow)
        except RuntimeError:   # shut down (interpreter exit): the entry stays dirty
            return
        self._writes += 1
        self.grad_rows_moved += bool(rows & G)
        entry.evict = evict
        entry.busy = busy
        entry.busy.add_done_callback(lambda f: self._write_done(entry, rows, new_gen, cow, f))

    def _write_rows(self, entry: _Entry, rows: int, need: dict[int, list[int] | None],
                    old_path: str, path: str, cow: bool) -> dict[int, list[int]]:
        """Write `rows` of the entry to path (cow: a new file), the rows of `need` first read
        from old_path (verified: a damaged row is never copied into a file with fresh sums)."""
        key = entry.key
        for read in self._read_rows(entry, old_path, need):
            read.result()
        try:
            if cow:
                self.io.close_fd(self.io.open(path, create=True))
                os.truncate(path, self.record_bytes(key[0]))
            futures = {p: self.io.write(path, self.offset(key, p), self._span(entry, p, 1))
                       for p in rows_of(rows)}
            return {p: f.result() for p, f in futures.items()}
        except OSError as err:
            raise OSError(err.errno, f"write-back of expert {entry.key}: {err.strerror}") \
                from err

    def _write_done(self, entry: _Entry, rows: int, new_gen: int, cow: bool,
                    future: Future) -> None:
        with self._lock:
            self._writes -= 1
            entry.busy = None
            key = entry.key
            if future.exception() is not None:
                entry.error = future.exception()
                entry.evict = False
            else:
                if cow:
                    self.frozen.discard(key)
                    self.gen[key] = new_gen
                    self.sums[key] = {}
                    old = self.path(key, new_gen - 1)
                    try:
                        os.unlink(old)     # the checkpoint keeps its own link
                    except FileNotFoundError:
                        pass
                self.sums[key].update(future.result())
                entry.valid |= rows & ~entry.valid
                entry.dirty = 0
                if rows & G:
                    self.grad_on_disk.add(key)
                if entry.evict and not entry.pins:
                    del self._cache[key]
                    self.pool.give(entry.slot)
                entry.evict = False
            self._changed.notify_all()
            self._pump()

    def flush(self, drop: bool = False) -> None:
        """Write every dirty entry back and wait (drop: also empty the cache)."""
        if self.pool is None:
            return
        with self._lock:
            while True:
                errors = [e for e in self._cache.values() if e.error is not None and not e.busy]
                if errors:
                    error, errors[0].error = errors[0].error, None
                    raise error
                todo = [e for e in self._cache.values()
                        if e.dirty and not e.pins and e.busy is None]
                busy = [e for e in self._cache.values() if e.busy is not None]
                for entry in todo:
                    self._start_write(entry, evict=False)
                if not todo and not busy:
                    break
                self._changed.wait()
            if drop:
                for entry in list(self._cache.values()):
                    self._drop_if_idle(entry)

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
            self._writeback.shutdown(wait=True)
            self.io.close()
            if self.pool is not None:
                self.pool.close()


