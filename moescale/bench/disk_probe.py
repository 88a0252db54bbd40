"""Disk measurements for the disk-tier benchmark, taken where the cost is paid.

- `store_path_bandwidth(directory, cold_files, ...)`: read, write and mixed rates of the
  store's own I/O path (moescale.offload.direct_io: O_DIRECT, 8 MiB chunks on the same
  reader/writer thread pools, records of the benchmark's size with as many in flight as the
  store keeps); reads come from the store's own record files, each read once, so no cache
  (the kernel's or a virtual disk's host) can serve them: a small probe file written just
  before is read back from the host's cache at twice the disk's rate here;
- `dd_bandwidth(directory, cold_files, ...)`: `dd` with `iflag=direct` / `oflag=direct` at the
  store's request size on other cold files and a scratch file (the raw reference);
- `reset_peak_rss` / `peak_rss_bytes` / `ProcessIO` (moescale/proc_stats.py, re-exported):
  VmHWM from a point on, the process's device-level bytes (/proc/self/io); the page cache size
  is proc_stats.page_cache_bytes;
- `DiskBusy`: the busy time of the directory's block device (/proc/diskstats).
- `cpu_flags()`: the instruction-set flags that matter for the results (avx2, avx512*, amx*).

Deliberately not here: what is benchmarked (offload_disk.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import deque

from moescale.offload.direct_io import DirectIO, SlotPool, align_up


def cpu_flags() -> list[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) \
        if re.search(r"^flags\s*:", text, re.M) else set()
    return sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx", "fma")))


def _block_device(directory: str) -> str | None:
    """The /proc/diskstats name of the whole device holding directory (None if unknown)."""
    dev = os.stat(directory).st_dev
    path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(path):
        return None
    real = os.path.realpath(path)
    name = os.path.basename(real)
    parent = os.path.basename(os.path.dirname(real))   # a partition's parent is the disk
    return parent if os.path.exists(f"/sys/block/{parent}") else name


class DiskBusy:
    """Milliseconds the directory's block device was busy (io_ticks) since the last take()."""

    def __init__(self, directory: str) -> None:
        self.device = _block_device(directory)
        self._last = self._ticks()

    def _ticks(self) -> int | None:
        if self.device is None:
            return None
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if fields[2] == self.device:
                    return int(fields[12])
        return None

    def take(self) -> float | None:
        now = self._ticks()
        if now is None or self._last is None:
            return None
        delta, self._last = (now - self._last) / 1000.0, now
        return delta


def _stream(io: DirectIO, kind: str, requests: list[tuple[str, int]], bufs: list,
            inflight: int):
    """Generator driving one stream of (path, offset) requests of len(bufs[0]) bytes each;
    yields after each submission, so several streams can be interleaved."""
    pending: deque = deque()
    for i, (path, off) in enumerate(requests):
        if len(pending) == inflight:
            pending.popleft().result()
        view = bufs[i % inflight]
        pending.append(io.write(path, off, view, create=True) if kind == "write"
                       else io.read(path, off, view))
        yield
    while pending:
        pending.popleft().result()


def _run(*streams, synced: list[str] = ()) -> float:
    """Seconds to drain the streams (interleaved), fsyncing `synced` at the end."""
    start = time.perf_counter()
    active = list(streams)
    while active:
        for s in list(active):
            try:
                next(s)
            except StopIteration:
                active.remove(s)
    for path in synced:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def store_path_bandwidth(directory: str, cold_files: list[str], request_bytes: int,
                         nbytes: int, threads: int = 4, inflight: int = 2,
                         read_share: float = 0.5) -> dict:
    """Bytes/s of the store's direct I/O path: `read` of the first request_bytes of files
    from `cold_files` (the store's own record files, each read once: no cache of any level can
    have them), `write` of random data over an allocated scratch file (fsynced), and `mixed`:
    a read stream and a write stream at once, in the proportion read_share of the bytes (as a
    training step moves them), aggregate. Consumes the cold files it reads from the list."""
    request_bytes = align_up(request_bytes)
    count = max(1, nbytes // request_bytes)
    io = DirectIO(threads)
    pool = SlotPool(2 * inflight, request_bytes)
    scratch = os.path.join(directory, f".moescale-bandwidth-{os.getpid()}.bin")
    out = {}
    try:
        for b in pool.slots:
            b.random_(0, 255)
        rbufs, wbufs = pool.slots[:inflight], pool.slots[inflight:]
        writes = [(scratch, i * request_bytes) for i in range(count)]
        _run(_stream(io, "write", writes, wbufs, inflight))   # allocate, as the store's are

        def cold(n):
            taken = [(cold_files.pop(), 0) for _ in range(min(n, len(cold_files)))]
            return taken
        out["write"] = count * request_bytes / _run(
            _stream(io, "write", writes, wbufs, inflight), synced=[scratch])
        reads = cold(count)
        out["read"] = len(reads) * request_bytes / _run(_stream(io, "read", reads, rbufs,
                                                                 inflight))
        reads = cold(int(count * read_share))
        mixed_writes = writes[:max(1, count - len(reads))]
        out["mixed"] = (len(reads) + len(mixed_writes)) * request_bytes / _run(
            _stream(io, "read", reads, rbufs, inflight),
            _stream(io, "write", mixed_writes, wbufs, inflight), synced=[scratch])
        return out
    finally:
        io.close()
        pool.close()
        if os.path.exists(scratch):
            os.remove(scratch)


def dd_bandwidth(directory: str, cold_files: list[str], file_bytes: int, nbytes: int,
                 block: int) -> dict | None:
    """Bytes/s of `dd` with direct I/O at `block` bytes per request: `read` of the first
    file_bytes of cold files (consumed from the list, as store_path_bandwidth does), `write`
    of random data (from a source held in the page cache) over an allocated file, fsynced."""
    if file_bytes < block:
        return None      # nothing whole to read at that request size
    src = os.path.join(directory, f".moescale-dd-src-{os.getpid()}.bin")
    path = os.path.join(directory, f".moescale-dd-{os.getpid()}.bin")
    count = max(1, nbytes // block)
    out = {}
    try:
        with open(src, "wb") as f:
            chunk = os.urandom(block)
            for _ in range(count):
                f.write(chunk)
        shutil.copyfile(src, path)   # dd overwrites allocated blocks, as the store does
        start = time.perf_counter()
        proc = subprocess.run(["dd", f"bs={block}", f"count={count}", f"if={src}", f"of={path}",
                               "oflag=direct", "conv=fsync,notrunc"], capture_output=True)
        if proc.returncode != 0:
            return None
        out["write"] = count * block / (time.perf_counter() - start)
        files = [cold_files.pop() for _ in range(min(len(cold_files),
                                                     max(1, nbytes // file_bytes)))]
        start = time.perf_counter()
        for f in files:
            proc = subprocess.run(["dd", f"bs={block}", f"count={file_bytes // block}",
                                   f"if={f}", "of=/dev/null", "iflag=direct"],
                                  capture_output=True)
            if proc.returncode != 0:
                return None
        out["read"] = len(files) * (file_bytes // block) * block / (time.perf_counter() - start)
        return out
    except FileNotFoundError:
        return None
    finally:
        for p in (src, path):
            if os.path.exists(p):
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                os.remove(p)
