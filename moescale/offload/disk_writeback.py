"""The disk tier's write-back half: dirty rows of cached records written to their files off the
caller's thread, copy on write after a checkpoint, and `flush`.

A write runs on a coordinator thread (`_writeback`, max_writes at a time), the lock never held
across I/O. An expert whose file a checkpoint linked (`frozen`) is written to a new file
(generation + 1) holding every row that persists, the rows the slot lacks read (verified) from
the linked file first; the old name is then unlinked (the checkpoint keeps its link). Every
write records the xxh3-64 of each chunk it wrote (`sums`), which later reads are checked
against.

`DiskWriteBack` is a part of DiskTier (disk_tier.py), whose state it uses: the cache entries,
the lock and its condition, the file generations and the sums.

Deliberately not here: reads, slots and eviction (disk_tier.py), direct I/O (direct_io.py).
"""

from __future__ import annotations

import os
from concurrent.futures import Future

from moescale.offload.records import STATE, G, rows_of


class DiskWriteBack:
    """Write-back and flush of DiskTier's cached records (see the module docstring)."""

    def _start_write(self, entry, evict: bool) -> None:
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

    def _write_rows(self, entry, rows: int, need: dict[int, list[int] | None],
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

    def _write_done(self, entry, rows: int, new_gen: int, cow: bool,
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
