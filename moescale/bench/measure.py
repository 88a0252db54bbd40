"""Measurement probes shared by the benchmarks: interleaved timing, saved activations, hardware.

- `time_interleaved` runs several implementations round-robin (one step of each per
  repetition), so that load from other processes on a shared machine hits them alike, and
  returns every implementation's per-repetition times; medians are taken by the caller.
  `rotate=True` starts repetition i at item i (mod n), so that no implementation always runs
  first or always after the same neighbour.
- `SavedBytes` counts the bytes autograd keeps for backward, through
  `torch.autograd.graph.saved_tensors_hooks`: each storage once, parameters excluded.
- `hardware_tag` names the machine for result file names (`cpu-2c-avx2`, `cuda-nvidia-h200`).
- `write_json` writes a result file atomically (temp file in the same folder, fsync, replace).
- `result_path(out, filename)`: where a benchmark's JSON goes: `--out` when given, else
  runs/bench/<timestamp>/<filename>, so a trial run from the repository root never
  overwrites the committed results (`--out benchmarks/results/<filename>` updates one).

This file measures; it does not decide what is compared, and it never changes thread counts or
any global torch setting.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from moescale.atomic import atomic_write_json
from moescale.bench.disk_probe import cpu_flags


def hardware_tag(device: torch.device) -> str:
    """A short file-name-safe description of the device the benchmark ran on."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    cores = os.cpu_count() or 1
    try:
        isa = torch.backends.cpu.get_cpu_capability().lower()
    except Exception:  # noqa: BLE001 - older builds lack the query; the tag is only a name
        isa = "cpu"
    amx = "-amx" if "amx_bf16" in cpu_flags() else ""   # matrix units: bf16 GEMMs differ
    return f"cpu-{cores}c-{isa}{amx}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timed:
    """One implementation in an interleaved timing run."""

    name: str
    step: Callable[[], None]             # one forward + backward
    reset: Callable[[], None]            # drops gradients; runs outside the timed region
    runs: int                            # timed repetitions wanted (after warm-up)
    warmup: int = 1
    exclude: list[torch.Tensor] | None = None   # when set: count saved bytes in warm-up 1
    slow_s: float | None = None          # warm-up slower than this: one timed run only
    times_s: list[float] = field(default_factory=list)
    warmup_s: list[float] = field(default_factory=list)
    saved_bytes: int | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s) if self.times_s else float("nan")


def time_interleaved(items: Sequence[Timed], device: torch.device,
                     progress: Callable[[str], None] | None = None,
                     rotate: bool = False) -> None:
    """Round-robin timing: repetition i runs every item that still wants a run, in order
    (rotated by i places when `rotate`).

    An item whose warm-up took longer than its `slow_s` seconds is timed once more only (its
    `runs` becomes 1); callers report that. The first warm-up of an item with `exclude` set
    also counts its saved activations (`saved_bytes`).
    """
    if any(it.warmup < 1 for it in items):
        raise ValueError("warmup must be >= 1 (the first run also measures saved activations)")
    total = max(it.warmup + it.runs for it in items) if items else 0
    for rep in range(total):
        shift = rep % len(items) if rotate else 0
        for it in [*items[shift:], *items[:shift]]:
            if rep >= it.warmup + it.runs:
                continue
            it.reset()
            synchronize(device)
            start = time.perf_counter()
            if rep == 0 and it.exclude is not None:
                with SavedBytes(it.exclude) as probe:
                    it.step()
                it.saved_bytes = probe.nbytes
            else:
                it.step()
            synchronize(device)
            elapsed = time.perf_counter() - start
            it.reset()
            if rep < it.warmup:
                it.warmup_s.append(elapsed)
                if it.slow_s is not None and rep == it.warmup - 1 and elapsed > it.slow_s:
                    it.runs = min(it.runs, 1)
            else:
                it.times_s.append(elapsed)
            if progress is not None:
                kind = "warm-up" if rep < it.warmup else "run"
                progress(f"  {it.name:<28} {kind} {rep + 1}: {elapsed * 1e3:9.1f} ms")


class SavedBytes:
    """Context manager: bytes of the distinct storages autograd saves, parameters excluded.

    Use around a forward pass; `nbytes` is then what the graph holds for backward (all saved
    tensors are alive until backward runs, so this is the peak of saved activations).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._storages: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            key = _storage_key(t)
            if key not in self._excluded:
                self._storages[key] = max(self._storages.get(key, 0),
                                          t.untyped_storage().nbytes())
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def write_json(path: Path, payload: dict) -> None:
    """Atomic JSON write (moescale.atomic: temp file, fsync, os.replace)."""
    atomic_write_json(path, payload)


COMMITTED = Path("benchmarks/results")     # the repository's recorded results


def result_path(out: str | None, filename: str) -> Path:
    """`out` when given, else runs/bench/<timestamp>/<filename> (see the module docstring)."""
    if out:
        return Path(out)
    return Path("runs") / "bench" / time.strftime("%Y%m%d-%H%M%S") / filename

