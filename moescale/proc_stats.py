"""This process's figures from /proc, for whoever reports them (the benchmarks, generation's
statistics): the bytes it read and wrote at the block device, and its peak resident set.

- `ProcessIO`: /proc/self/io `read_bytes` / `write_bytes` since the last `take()`: what reached
  the block layer, not the page cache;
- `reset_peak_rss` / `peak_rss_bytes`: VmHWM, the peak resident set, from a point on;
- `page_cache_bytes`: the machine's page cache (/proc/meminfo `Cached`).

Deliberately not here: disk bandwidth probes and the block device's busy time
(bench/disk_probe.py).
"""

from __future__ import annotations


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


def reset_peak_rss() -> None:
    """Start VmHWM (the peak resident set) afresh from now (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _kib_field(path: str, name: str) -> int:
    """Bytes of a `name:  N kB` line of a /proc file (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """VmHWM: this process's peak resident set since start or reset_peak_rss()."""
    return _kib_field("/proc/self/status", "VmHWM")


def page_cache_bytes() -> int:
    """The machine's page cache now (grows when reads or writes go through it)."""
    return _kib_field("/proc/meminfo", "Cached")
