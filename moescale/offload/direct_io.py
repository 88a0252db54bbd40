"""Direct file I/O for the disk tier: a fixed pool of aligned host slots, reads and writes that
bypass the page cache, split into chunks and served by thread pools.

- `SlotPool(num_slots, slot_bytes)`: equal, page-aligned buffers (anonymous mmaps, pinned with
  `cudaHostRegister` when asked) handed out and taken back; nothing is allocated per access, so
  the pool's size is the disk tier's real host memory (no hidden page cache beside it).
- `DirectIO`: `read(path, offset, view)` / `write(path, offset, view)` return a Future; each
  request is cut into `chunk_bytes` pieces that `threads` workers serve with `os.preadv` /
  `os.pwritev` (which release the GIL), so several requests are in flight at the device at
  once. Reads and writes have their own workers: a long write-back never queues a read behind
  it. Files are opened with `O_DIRECT`; where the filesystem refuses it (tmpfs), the I/O is
  buffered and followed by `posix_fadvise(DONTNEED)` so that the page cache does not keep
  what was moved, and `direct` is False (the store says so once). Every write returns the
  xxh3-64 checksum of each chunk it wrote, in offset order (the store's checkpoint manifest
  keeps them; xxh3 runs at ~14 GB/s here, crc32 at 2.5 GB/s would cost a core at disk speed).
  A read given those sums checks each chunk in the worker that read it, as it arrives (xxhash
  releases the GIL while it hashes, measured: docs/offloading.md), and fails with
  `CorruptReadError` naming the file and the chunk's byte offset on a mismatch.

Offsets, lengths and buffer addresses are multiples of `ALIGN` (4096: the largest logical block
size of common devices), as O_DIRECT requires.

Deliberately not here: what is read or written when (disk_tier.py), file names and formats.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

ALIGN = 4096
CHUNK_BYTES = 8 << 20


class CorruptReadError(OSError):
    """Bytes read from a file that do not match the xxh3-64 sum recorded when they were written
    (the file was changed under its writer: a failing disk, or another program)."""


def align_up(nbytes: int, align: int = ALIGN) -> int:
    return (nbytes + align - 1) // align * align


def chunk_sums(data_u8: torch.Tensor, chunk: int = CHUNK_BYTES) -> list[int]:
    """The xxh3-64 sum of each `chunk` bytes of a uint8 tensor, in order (what `write` returns
    for the same bytes)."""
    data = memoryview(data_u8.numpy())
    return [xxhash.xxh3_64_intdigest(data[s:s + chunk]) for s in range(0, len(data), chunk)]


class SlotPool:
    """`num_slots` page-aligned host buffers of `slot_bytes` each, reused for every access."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool = False) -> None:
        assert num_slots >= 1 and slot_bytes % ALIGN == 0
        self.slot_bytes = slot_bytes
        self._maps = [mmap.mmap(-1, slot_bytes) for _ in range(num_slots)]
        self.slots = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned = pin
        if pin:  # page-locked for asynchronous device copies (CUDA only)
            cudart = torch.cuda.cudart()
            for t in self.slots:
                cudart.cudaHostRegister(t.data_ptr(), slot_bytes, 0)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot's index, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} returned twice"
        self._free.append(slot)

    def close(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()
            for t in self.slots:
                cudart.cudaHostUnregister(t.data_ptr())
        self.slots.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()


def gather(futures: list[Future]) -> Future:
    """A Future of the list of the futures' results (the first error if one fails)."""
    out: Future = Future()
    if not futures:
        out.set_result([])
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result([f.result() for f in futures])
    for f in futures:
        f.add_done_callback(done)
    return out


class DirectIO:
    """Chunked O_DIRECT reads and writes on thread pools (buffered + DONTNEED as fallback)."""

    def __init__(self, threads: int = 4, chunk_bytes: int = CHUNK_BYTES,
                 direct: bool = True) -> None:
        """direct=False: always buffered I/O + DONTNEED (as where O_DIRECT is refused)."""
        if threads < 1:
            raise ValueError(f"io_threads={threads!r} must be >= 1")
        assert chunk_bytes % ALIGN == 0
        self.chunk_bytes = chunk_bytes
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="moescale-read")
        self._writers = ThreadPoolExecutor(threads, thread_name_prefix="moescale-write")
        self.direct: bool | None = None if direct else False   # False: some file is buffered
        self._try_direct = direct
        self._buffered: set[int] = set()   # fds of such files
        self.bytes_read = 0
        self.bytes_written = 0
        self.bytes_verified = 0    # bytes read and checked against their sums
        self.verify_s = 0.0        # seconds the readers spent hashing them (summed)
        self._count = threading.Lock()

    # ----------------------------------------------------------------- files
    def open(self, path: str, create: bool = False, write: bool = True) -> int:
        flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
        try:
            if self._try_direct:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                if self.direct is None:
                    self.direct = True
                return fd
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
        fd = os.open(path, flags, 0o644)   # this filesystem refuses O_DIRECT (tmpfs)
        with self._count:
            self.direct = False
            self._buffered.add(fd)
        return fd

    def close_fd(self, fd: int) -> None:
        with self._count:
            self._buffered.discard(fd)
        os.close(fd)

    # ----------------------------------------------------------------- requests
    def _pieces(self, offset: int, nbytes: int):
        for start in range(0, nbytes, self.chunk_bytes):
            yield start, min(self.chunk_bytes, nbytes - start)

    def read(self, path: str, offset: int, view: torch.Tensor, sums: list[int] | None = None,
             what: str = "a record") -> Future:
        """Fill the uint8 tensor `view` (aligned) from path at offset; Future of None. `sums`:
        the xxh3-64 of each `chunk_bytes` piece of the view, in order (what `write` returned
        for the same bytes at the same offset): each piece is checked by the worker that read
        it, and a mismatch fails the Future with CorruptReadError naming `what`, the file and
        the piece's byte offset."""
        pieces = -(-view.numel() // self.chunk_bytes)
        if sums is not None and len(sums) != pieces:
            raise ValueError(f"{len(sums)} checksums for the {pieces} chunks of a read of "
                             f"{view.numel()} bytes from {path!r}: they were recorded with "
                             "another chunk size")

        def piece(fd, path, offset, view, i):
            self._read_piece(fd, path, offset, view, None if sums is None else sums[i], what)
        return self._submit(self._readers, piece, path, offset, view, False, False)

    def write(self, path: str, offset: int, view: torch.Tensor, create: bool = False
              ) -> Future:
        """Write `view` to path at offset; Future of the chunks' xxh3-64 sums in offset order."""
        return self._submit(self._writers, self._write_piece, path, offset, view, create, True)

    def _submit(self, pool, piece, path, offset, view, create: bool, write: bool) -> Future:
        """Cut the request into chunks on `pool`; a failure to open the file comes back in
        the Future, like any I/O error."""
        assert offset % ALIGN == 0 and view.numel() % ALIGN == 0 and \
            view.data_ptr() % ALIGN == 0, "direct I/O needs aligned offset, length and buffer"
        try:
            fd = self.open(path, create, write)
        except OSError as err:
            failed: Future = Future()
            failed.set_exception(OSError(err.errno, f"opening {path!r} failed: {err.strerror}"))
            return failed
        futures = [pool.submit(piece, fd, path, offset + start, view[start:start + n], i)
                   for i, (start, n) in enumerate(self._pieces(offset, view.numel()))]
        out = gather(futures)
        out.add_done_callback(lambda _: self.close_fd(fd))
        return out

    def _read_piece(self, fd: int, path: str, offset: int, view: torch.Tensor,
                    expect: int | None, what: str) -> None:
        buf = memoryview(view.numpy())
        got = 0
        try:
            while got < len(buf):
                n = os.preadv(fd, [buf[got:]], offset + got)
                if n == 0:
                    raise OSError(errno.EIO, f"expert file {path!r} is truncated (ends before "
                                  f"byte {offset + len(buf)}); the disk tier's directory was "
                                  "modified")
                got += n
            if fd in self._buffered:
                os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        except OSError as err:
            raise OSError(err.errno, f"reading {path!r} failed: {err.strerror}") from err
        if expect is not None:
            start = time.perf_counter()
            digest = xxhash.xxh3_64_intdigest(buf)     # the GIL is released while it hashes
            with self._count:
                self.verify_s += time.perf_counter() - start
                self.bytes_verified += got
            if digest != expect:
                raise CorruptReadError(
                    errno.EIO, f"{what}: {path!r} does not match the checksum recorded when it "
                    f"was written (the {got:,}-byte chunk at byte offset {offset:,}): the file "
                    "was changed under the store (a failing disk, or another program writing "
                    "in the disk tier's directory)")
        with self._count:
            self.bytes_read += got

    def _write_piece(self, fd: int, path: str, offset: int, view: torch.Tensor, _: int) -> int:
        buf = memoryview(view.numpy())
        digest = xxhash.xxh3_64_intdigest(buf)
        done = 0
        try:
            while done < len(buf):
                n = os.pwritev(fd, [buf[done:]], offset + done)
                if n == 0:
                    raise OSError(errno.ENOSPC, "short write")
                done += n
            if fd in self._buffered:
                os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        except OSError as err:
            hint = "the disk is full; free space or choose another directory" \
                if err.errno == errno.ENOSPC else "check the disk tier's directory"
            raise OSError(err.errno, f"writing {path!r} failed ({err.strerror}): {hint}") \
                from err
        with self._count:
            self.bytes_written += done
        return digest

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
