"""Disk measurements for the disk-tier benchmark, taken where the cost is paid.

- `store_path_bandwidth(directory, nbytes, ...)`: read and write rates of the store's own I/O
  path (moescale.offload.direct_io: O_DIRECT, 8 MiB chunks on the same reader/writer thread
  pools, records of the benchmark's size with as many in flight as the store keeps);
- `dd_bandwidth(directory, nbytes, block)`: the same file size moved by `dd` with
  `iflag=direct` / `oflag=direct` at the store's request size (the raw reference);
- `ProcessIO` / `DiskBusy` / `page_cache_bytes`: the process's device-level bytes
  (/proc/self/io `read_bytes`, `write_bytes`: what reached the block layer, not the page
  cache), the busy time of the directory's block device (/proc/diskstats), and the kernel's
  page cache size (/proc/meminfo `Cached`).
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


class ProcessIO:
    """Device-level bytes this process read and wrote since the last `take()`."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        values = {}
        with open("/proc/self/io") as f:
            for line in f:
                name, _, value = line.partition(":")
                values[name] = int(value)
        return values["read_bytes"], values["write_bytes"]

    def take(self) -> tuple[int, int]:
        now = self._read()
        delta = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now
        return delta


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


def page_cache_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _stream(io: DirectIO, path: str, kind: str, nbytes: int, bufs: list, inflight: int):
    """Generator driving one request stream; yields after each submission."""
    request = bufs[0].numel()
    pending: deque = deque()
    for i, off in enumerate(range(0, nbytes, request)):
        if len(pending) == inflight:
            pending.popleft().result()
        view = bufs[i % inflight]
        pending.append(io.write(path, off, view, create=True) if kind == "write"
                       else io.read(path, off, view))
        yield
    while pending:
        pending.popleft().result()


def store_path_bandwidth(directory: str, nbytes: int, request_bytes: int, threads: int = 4,
                         inflight: int = 2, read_share: float = 0.5) -> dict:
    """Bytes/s of the store's direct I/O path on files of nbytes (written once first: like the
    store's, the timed writes go to allocated blocks): `read` alone, `write` alone (random
    data, fsynced), and `mixed`: a read stream and a write stream at once, in the proportion
    read_share of the bytes (as a training step moves them), aggregate."""
    request_bytes = align_up(min(request_bytes, nbytes))
    nbytes = max(1, nbytes // request_bytes) * request_bytes
    io = DirectIO(threads)
    pool = SlotPool(2 * inflight, request_bytes)
    paths = [os.path.join(directory, f".moescale-bandwidth-{os.getpid()}-{i}.bin")
             for i in range(2)]
    out = {}
    try:
        for b in pool.slots:
            b.random_(0, 255)
        rbufs, wbufs = pool.slots[:inflight], pool.slots[inflight:]

        def timed(*streams, synced: str | None = None) -> float:
            start = time.perf_counter()
            active = list(streams)
            while active:
                for s in list(active):
                    try:
                        next(s)
                    except StopIteration:
                        active.remove(s)
            if synced is not None:
                fd = os.open(synced, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            return time.perf_counter() - start

        for path in paths:   # the store overwrites allocated blocks: so does the probe
            for _ in _stream(io, path, "write", nbytes, wbufs, inflight):
                pass
        out["write"] = nbytes / timed(_stream(io, paths[0], "write", nbytes, wbufs, inflight),
                                      synced=paths[0])
        out["read"] = nbytes / timed(_stream(io, paths[0], "read", nbytes, rbufs, inflight))
        read_bytes = int(nbytes * read_share) // request_bytes * request_bytes
        write_bytes = (nbytes - read_bytes) // request_bytes * request_bytes
        out["mixed"] = (read_bytes + write_bytes) / timed(
            _stream(io, paths[0], "read", read_bytes, rbufs, inflight),
            _stream(io, paths[1], "write", write_bytes, wbufs, inflight), synced=paths[1])
        return out
    finally:
        io.close()
        pool.close()
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


def dd_bandwidth(directory: str, nbytes: int, block: int) -> dict | None:
    """Bytes/s of `dd` with direct I/O at `block` bytes per request: `write` of random data
    (from a source file held in the page cache, over an allocated file, fsynced) and `read`
    of it back."""
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
        for kind, args in (("write", [f"if={src}", f"of={path}", "oflag=direct",
                                      "conv=fsync,notrunc"]),
                           ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
            start = time.perf_counter()
            proc = subprocess.run(["dd", f"bs={block}", f"count={count}", *args],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                return None
            out[kind] = count * block / (time.perf_counter() - start)
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
