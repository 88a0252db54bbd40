"""ExpertStore: the authoritative state of every (layer, expert) outside the device.

Each expert is one fp32 record `data_4P` of four rows: the master parameters (all of the
expert's tensors flattened into P numbers), the gradient accumulator, and AdamW's two moments;
plus its optimizer step count (`step_t`, a scalar tensor as torch's AdamW wants) and a
`version` bumped by every optimizer step (device copies of an older version are stale).

Tiers:
- `host`: one `[E, 4, P]` tensor per layer in RAM, pinned under CUDA, optionally in shared
  memory (`share_memory_()`) so that several local ranks map one copy (`shared_state()` in
  the owner, `ExpertStore.attach(...)` in the others);
- `disk`: one raw fp32 file per expert under `directory/layer{l}/expert{e}.bin` (4*P numbers,
  row-major), read and written by a thread pool into a host cache bounded in **bytes**. Entries
  in use are pinned; eviction is schedule-aware: the layer tells the store the order in which
  experts will be touched (forward order after routing, backward is its reverse), and the store
  evicts the unpinned entry whose next use is farthest away (Belady), writing it back if dirty.
  `prefetch(keys)` starts reads in that order while the cache has room.

Errors: a missing, non-directory or unwritable disk directory raises ValueError at
construction; too little free space for the files raises OSError(ENOSPC) before anything is
written; a write that fails later (disk full) raises OSError naming the file.

Deliberately not here: the optimizer math (optimizer.py), device copies (cache.py), atomic
checkpoints of the store (checkpoint.py).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

MASTER, GRAD, EXP_AVG, EXP_AVG_SQ = 0, 1, 2, 3
TIERS = ("host", "disk")
Key = tuple[int, int]


class ExpertLayout:
    """The tensors of one expert (name -> shape), flattened in order into P fp32 numbers."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.names = [n for n, _ in shapes]
        self.shapes = [tuple(s) for _, s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)

    def split(self, flat_P: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a flat [P] tensor as the expert's named tensors."""
        return {n: part.view(shape) for n, shape, part in
                zip(self.names, self.shapes, torch.split(flat_P, self.sizes))}

    def record_bytes(self) -> int:
        return 4 * self.numel * 4


@dataclass(kw_only=True)
class StoreConfig:
    """Where expert state lives. host_cache_bytes bounds the disk tier's RAM cache."""

    tier: str = "host"
    directory: str | None = None
    host_cache_bytes: int | None = None
    pin_memory: bool = False
    shared_memory: bool = False
    io_threads: int = 4

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r} is unknown; use one of {', '.join(TIERS)}")
        if self.tier == "disk":
            if self.directory is None:
                raise ValueError("tier='disk' needs directory=<an existing writable directory "
                                 "for the expert files>")
            if self.host_cache_bytes is None or self.host_cache_bytes < 1:
                raise ValueError(f"host_cache_bytes={self.host_cache_bytes!r}: the disk tier "
                                 "needs a positive host cache size in bytes (e.g. 1 << 30)")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads!r} must be >= 1")


class ExpertRecord:
    """One expert's state: data_4P rows MASTER, GRAD, EXP_AVG, EXP_AVG_SQ; step_t; version."""

    def __init__(self, key: Key, data_4P: torch.Tensor, step_t: torch.Tensor) -> None:
        self.key, self.data_4P, self.step_t = key, data_4P, step_t
        self.pins = 0
        self.dirty = False
        self.loading: Future | None = None

    @property
    def master_P(self) -> torch.Tensor:
        return self.data_4P[MASTER]

    @property
    def grad_P(self) -> torch.Tensor:
        return self.data_4P[GRAD]

    @property
    def exp_avg_P(self) -> torch.Tensor:
        return self.data_4P[EXP_AVG]

    @property
    def exp_avg_sq_P(self) -> torch.Tensor:
        return self.data_4P[EXP_AVG_SQ]


def check_directory(directory: str, need_bytes: int) -> None:
    """Raise a clear error unless `directory` exists, is writable and has need_bytes free."""
    if not os.path.exists(directory):
        raise ValueError(f"directory={directory!r} does not exist; create it (mkdir -p) or "
                         "point the disk tier at an existing directory")
    if not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r} is not a directory; give a directory for "
                         "the expert files")
    probe = os.path.join(directory, f".moescale-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"directory={directory!r} is not writable ({err.strerror}); choose a "
                         "writable directory for the disk tier") from err
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"the disk tier needs {need_bytes} bytes "
                      f"({need_bytes / 2**30:.2f} GiB) under {directory!r} but only {free} "
                      f"bytes ({free / 2**30:.2f} GiB) are free; free space or choose another "
                      "directory")


class ExpertStore:
    """Per-(layer, expert) fp32 state on the host or on disk; thread-safe."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.layouts: list[ExpertLayout] = []
        self.num_experts: list[int] = []
        self._host: list[torch.Tensor] = []            # host tier: [E, 4, P] per layer
        self._steps: dict[Key, torch.Tensor] = {}
        self._host_steps: list[torch.Tensor] = []     # [E] step counts per layer
        self.versions: dict[Key, int] = {}
        self._cache: OrderedDict[Key, ExpertRecord] = OrderedDict()  # disk tier, LRU order
        self._cache_bytes = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._upcoming: deque[Key] = deque()
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="moescale-io") \
            if config.tier == "disk" else None
        self.bytes_read = 0
        self.bytes_written = 0
        self.peak_cache_bytes = 0

    # ----------------------------------------------------------------- construction
    def add_layer(self, layout: ExpertLayout, num_experts: int,
                  init: Callable[[int], torch.Tensor]) -> int:
        """Add a layer of experts whose masters are init(e) (flat [P]); returns its index."""
        layer = len(self.layouts)
        if self.config.tier == "disk":
            need = layout.record_bytes() * num_experts
            if 2 * layout.record_bytes() > self.config.host_cache_bytes:
                raise ValueError(
                    f"host_cache_bytes={self.config.host_cache_bytes} holds fewer than two "
                    f"expert records of {layout.record_bytes()} bytes each; raise it to at least "
                    f"{2 * layout.record_bytes()}")
            check_directory(self.config.directory, need)
            os.makedirs(self._layer_dir(layer), exist_ok=True)
        data_E4P = None
        steps_E = torch.zeros(num_experts, dtype=torch.float32)
        if self.config.tier == "host":
            data_E4P = torch.zeros(num_experts, 4, layout.numel, dtype=torch.float32)
            if self.config.shared_memory:
                data_E4P.share_memory_()
                steps_E.share_memory_()
                if self.config.pin_memory:  # pin the shared pages in place (no copy)
                    torch.cuda.cudart().cudaHostRegister(
                        data_E4P.data_ptr(), data_E4P.numel() * data_E4P.element_size(), 0)
            elif self.config.pin_memory:
                data_E4P = data_E4P.pin_memory()
        self._register(layout, data_E4P, steps_E)
        for e in range(num_experts):
            key = (layer, e)
            master_P = init(e).detach().reshape(-1).to(torch.float32)
            if master_P.numel() != layout.numel:
                raise ValueError(f"init({e}) has {master_P.numel()} numbers; the layout wants "
                                 f"{layout.numel}")
            if data_E4P is not None:
                data_E4P[e, MASTER].copy_(master_P)
            else:
                rec_4P = torch.zeros(4, layout.numel, dtype=torch.float32)
                rec_4P[MASTER].copy_(master_P)
                self._write(key, rec_4P)
        return layer

    def shared_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (data_E4P, steps_E) of a host store in shared memory, to hand to other
        local processes (torch.multiprocessing pickles them as shared-memory handles)."""
        if self.config.tier != "host" or not self.config.shared_memory:
            raise ValueError("shared_state() needs tier='host' with shared_memory=True")
        return list(zip(self._host, self._host_steps))

    @classmethod
    def attach(cls, config: StoreConfig, layouts: Sequence[ExpertLayout],
               state: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "ExpertStore":
        """A store over another process's shared_state(): one copy of the experts, several
        processes. Versions are per process (each process's device copies are its own)."""
        store = cls(config)
        for layout, (data_E4P, steps_E) in zip(layouts, state, strict=True):
            if tuple(data_E4P.shape[1:]) != (4, layout.numel):
                raise ValueError(f"shared tensor of shape {tuple(data_E4P.shape)} does not hold "
                                 f"records of {layout.numel} parameters")
            store._register(layout, data_E4P, steps_E)
        return store

    def _register(self, layout: ExpertLayout, data_E4P: torch.Tensor | None,
                  steps_E: torch.Tensor) -> None:
        """Append a layer of len(steps_E) experts (data_E4P: its host-tier records, None on
        disk): layout, step counts, versions."""
        layer = len(self.layouts)
        self.layouts.append(layout)
        self.num_experts.append(steps_E.numel())
        if data_E4P is not None:
            self._host.append(data_E4P)
        self._host_steps.append(steps_E)
        for e in range(steps_E.numel()):
            self._steps[(layer, e)] = steps_E[e]  # a 0-dim view: AdamW increments it in place
            self.versions[(layer, e)] = 0

    def keys(self) -> Iterable[Key]:
        for layer, n in enumerate(self.num_experts):
            for e in range(n):
                yield (layer, e)

    # ----------------------------------------------------------------- access
    def acquire(self, key: Key) -> ExpertRecord:
        """The record of `key`, loaded and pinned until `release(key)` (blocks on disk reads)."""
        if self.config.tier == "host":
            layer, e = key
            return ExpertRecord(key, self._host[layer][e], self._steps[key])
        with self._lock:
            self._consume_upcoming(key)
            rec = self._cache.get(key)
            if rec is None:
                rec = self._start_load(key, block=True)
            rec.pins += 1
            self._cache.move_to_end(key)
            loading = rec.loading
        if loading is not None:
            try:
                loading.result()
            except BaseException:
                with self._lock:  # a failed read leaves no entry behind
                    rec.pins -= 1
                    if self._cache.get(key) is rec and not rec.pins:
                        del self._cache[key]
                        self._cache_bytes -= self.layouts[key[0]].record_bytes()
                        self._changed.notify_all()
                raise
        return rec

    def read_master(self, key: Key) -> tuple[torch.Tensor, Callable[[], None]]:
        """(master_P, done): the expert's fp32 master for an upload. On the disk tier an
        uncached expert's master row alone is read from its file (a quarter of the record),
        without a cache entry; call done() once the copy is made. The caller has waited for
        the expert's step fence, so the file's master is current."""
        if self.config.tier == "disk":
            with self._lock:
                cached = key in self._cache
                if not cached:
                    self._consume_upcoming(key)
            if not cached:
                numel = self.layouts[key[0]].numel
                out_P = torch.empty(numel, dtype=torch.float32)
                self._read(key, out_P, nbytes=4 * numel)
                return out_P, lambda: None
        rec = self.acquire(key)
        return rec.master_P, lambda: self.release(key)

    def read_record(self, key: Key) -> tuple[torch.Tensor, float]:
        """A copy of one expert's record [4, P] (master, grad, moments) and its step count."""
        rec = self.acquire(key)
        try:
            return rec.data_4P.clone(), float(rec.step_t)
        finally:
            self.release(key)

    def release(self, key: Key, dirty: bool = False) -> None:
        if self.config.tier == "host":
            return
        with self._lock:
            rec = self._cache[key]
            assert rec.pins > 0, f"release of {key} that is not acquired"
            rec.pins -= 1
            rec.dirty |= dirty
            self._changed.notify_all()

    def bump_version(self, key: Key) -> None:
        with self._lock:
            self.versions[key] += 1

    # ----------------------------------------------------------------- disk-tier cache
    def set_upcoming(self, keys: Sequence[Key], keep=None) -> None:
        """The expected order of the next accesses (for eviction and prefetch). Accesses of
        the old list for which keep(key) is true (work already queued) stay in front."""
        with self._lock:
            kept = [k for k in self._upcoming if keep(k)] if keep is not None else []
            self._upcoming = deque(kept + list(keys))

    def prefetch(self, keys: Sequence[Key]) -> None:
        """Start reads of `keys` (in order) while the cache has room without evicting an
        entry needed sooner; never blocks."""
        if self.config.tier == "host":
            return
        with self._lock:
            for key in keys:
                if key not in self._cache and self._start_load(key, block=False) is None:
                    break

    def _consume_upcoming(self, key: Key) -> None:
        if self._upcoming and self._upcoming[0] == key:
            self._upcoming.popleft()
        elif key in self._upcoming:
            self._upcoming.remove(key)

    def _next_use(self, key: Key) -> float:
        try:
            return self._upcoming.index(key)
        except ValueError:
            return math.inf

    def _start_load(self, key: Key, block: bool) -> ExpertRecord | None:
        """Reserve room for key's record (evicting) and start its read. Lock held."""
        nbytes = self.layouts[key[0]].record_bytes()
        while self._cache_bytes + nbytes > self.config.host_cache_bytes:
            victim = self._victim(below=None if block else self._next_use(key))
            if victim is None:
                if not block:
                    return None
                self._changed.wait()
                if key in self._cache:
                    return self._cache[key]
                continue
            self._evict(victim)
        rec = ExpertRecord(key, torch.empty(4, self.layouts[key[0]].numel), self._steps[key])
        self._cache[key] = rec
        self._cache_bytes += nbytes
        self.peak_cache_bytes = max(self.peak_cache_bytes, self._cache_bytes)
        rec.loading = self._io.submit(self._read, key, rec.data_4P)
        rec.loading.add_done_callback(self._loaded)
        return rec

    def _loaded(self, _future) -> None:
        with self._lock:  # a finished read makes its entry evictable: wake blocked loads
            self._changed.notify_all()

    def _victim(self, below: float | None) -> ExpertRecord | None:
        """The unpinned, loaded entry used farthest in the future (None if none qualifies;
        with `below`, only entries used later than that position)."""
        best, best_use = None, -1.0
        for rec in self._cache.values():  # LRU first: ties go to the least recently used
            if rec.pins or (rec.loading is not None and not rec.loading.done()):
                continue
            use = self._next_use(rec.key)
            if use > best_use:
                best, best_use = rec, use
        if best is None or (below is not None and best_use <= below):
            return None
        return best

    def _evict(self, rec: ExpertRecord) -> None:
        if rec.dirty:
            self._write(rec.key, rec.data_4P)
        del self._cache[rec.key]
        self._cache_bytes -= self.layouts[rec.key[0]].record_bytes()

    def flush(self) -> None:
        """Write every dirty cached record back to its file."""
        with self._lock:
            for rec in self._cache.values():
                if rec.dirty and not rec.pins:
                    self._write(rec.key, rec.data_4P)
                    rec.dirty = False

    def drop_cache(self) -> None:
        """Write back and drop every unpinned cached record (frees the host cache)."""
        with self._lock:
            for rec in list(self._cache.values()):
                if not rec.pins and (rec.loading is None or rec.loading.done()):
                    self._evict(rec)

    def cache_bytes(self) -> int:
        return self._cache_bytes

    # ----------------------------------------------------------------- files
    def _layer_dir(self, layer: int) -> str:
        return os.path.join(self.config.directory, f"layer{layer:03d}")

    def path(self, key: Key) -> str:
        return os.path.join(self._layer_dir(key[0]), f"expert{key[1]:05d}.bin")

    def _read(self, key: Key, out_4P: torch.Tensor, nbytes: int | None = None) -> None:
        """Read the record (or its first nbytes: the master row) into out_4P."""
        path = self.path(key)
        view = memoryview(out_4P.numpy()).cast("B")
        if nbytes is not None:
            view = view[:nbytes]
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(view)
        except OSError as err:
            raise OSError(err.errno, f"reading expert {key} from {path!r} failed: "
                          f"{err.strerror}") from err
        if got != len(view):
            raise OSError(errno.EIO, f"expert file {path!r} is truncated ({got} of "
                          f"{len(view)} bytes); the disk tier's directory was modified")
        self.bytes_read += got

    def _write(self, key: Key, data_4P: torch.Tensor) -> None:
        path = self.path(key)
        view = memoryview(data_4P.contiguous().numpy()).cast("B")
        try:
            mode = "r+b" if os.path.exists(path) else "wb"
            with open(path, mode, buffering=0) as f:
                written = f.write(view)
                f.flush()
            if written != len(view):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as err:
            hint = "the disk is full; free space or choose another directory" \
                if err.errno == errno.ENOSPC else "check the disk tier's directory"
            raise OSError(err.errno, f"writing expert {key} to {path!r} failed "
                          f"({err.strerror}): {hint}") from err
        self.bytes_written += len(view)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._io is not None:
            self.flush()
            self._io.shutdown(wait=True)
