"""Peak RSS delta of one forward + backward of one `moescale bench layer` implementation.

Each measurement runs in a fresh Python process (`python -m moescale.bench.layer_memory_child`),
so
that no other implementation's freed heap is reused or counted: it builds the same case as the
benchmark (same weights, same input), runs one warm-up step (one-time allocations: oneDNN
scratch, thread pools, the first weight gradients), drops the gradients, returns freed heap to
the kernel (`malloc_trim(0)`; moescale's layer also drops the gradient storage it keeps from
one backward to the next, layers/grad_buffers.py, so that its weight gradients are counted as
memory the step needs, as the floors' are), reads VmRSS, resets the high-water mark
(`/proc/self/clear_refs` with "5") and runs one more step; the delta is VmHWM - VmRSS. It
therefore counts everything a step allocates and touches: saved activations, transients and
the weight gradients. As in
`bench ep-memory`, glibc is told first to hand every freed block of 64 KiB or more back to the
kernel at once (`ep_memory_rank.release_freed_memory`), so the resident set follows the live
tensors (the step's working set), not what the heap happens to keep of freed ones.

Linux only (needs /proc/self/clear_refs and glibc's malloc_trim); elsewhere `measure` returns
None and the benchmark reports the cell without a memory figure. This file times nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import asdict

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def step_rss_delta(step, reset) -> int:
    """Bytes: peak RSS during step() above the RSS just before it (after one warm-up)."""
    reset()
    step()
    reset()
    _trim_heap()
    before_kib = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    peak_kib = _status_kib("VmHWM")
    reset()
    return max(0, peak_kib - before_kib) * 1024


def measure(impl: str, family: str, case, dtype_name: str, opts, timeout_s: float = 900.0):
    """Peak RSS delta (bytes) of `impl` on this case in a fresh process; None if unavailable."""
    if not (os.path.exists("/proc/self/clear_refs") and sys.platform.startswith("linux")):
        return None
    peers = []
    if family == "peer":
        peers = ["deepspeed"] if impl.startswith("deepspeed") else ["hf"]
    options = {**asdict(opts), "peers": peers, "configs": [], "dtypes": [dtype_name],
               "out": None}
    spec = {"impl": impl, "dtype": dtype_name, "case": asdict(case), "options": options,
            "threads": torch.get_num_threads()}
    proc = subprocess.run([sys.executable, "-m", "moescale.bench.layer_memory_child",
                           json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"memory probe of {impl!r} failed (rc {proc.returncode}): {tail[0]}")
    return json.loads(lines[-1])["rss_delta_bytes"]
