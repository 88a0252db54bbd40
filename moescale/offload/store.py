"""ExpertStore: the authoritative state of every (layer, expert) outside the device.

Each expert is one fp32 record of four rows: the master parameters (all of the expert's
tensors flattened into P numbers), the gradient accumulator, and AdamW's two moments; plus its
optimizer step count (`step_t`, a scalar tensor as torch's AdamW wants) and a `version` bumped
by every optimizer step (device copies of an older version are stale).

Tiers:
- `host`: one `[E, 4, P]` tensor per layer in RAM, pinned under CUDA, optionally in shared
  memory (`share_memory_()`) so that several local ranks map one copy (`shared_state()` in
  the owner, `ExpertStore.attach(...)` in the others);
- `disk`: one file per expert, moved by direct I/O through a fixed pool of host slots whose
  size (`host_cache_bytes`) is the tier's real host memory; reads ahead and writes behind from
  the schedule the layers announce (`set_upcoming`), Belady eviction; only the rows an access
  needs are read and a zero gradient accumulator is never persisted (disk_tier.py).

Errors: a missing, non-directory or unwritable disk directory raises ValueError at
construction; too little free space for the files raises OSError(ENOSPC) before anything is
written (`reserve_disk` checks every layer at once); a write that fails later (disk full)
raises OSError naming the file.

`thread_read_wait_s()`: the seconds the calling thread has blocked in disk-tier acquires (a
training step's own record reads, e.g. its gradient-norm pass; counted per thread, so the copy
and optimizer threads' reads are not the step's).

Deliberately not here: the optimizer math (optimizer.py), device copies (cache.py), atomic
checkpoints of the store (checkpoint.py), the disk tier's I/O (disk_tier.py, direct_io.py).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from moescale.dir_lock import claim_directory
from moescale.offload import records
from moescale.offload.direct_io import align_up
from moescale.offload.disk_tier import DiskTier
from moescale.offload.records import ALL

MASTER, GRAD, EXP_AVG, EXP_AVG_SQ = 0, 1, 2, 3
# where each of those rows sits in a disk-tier record file / slot
LOGICAL_POS = (records.POS_MASTER, records.POS_GRAD, records.POS_EXP_AVG,
               records.POS_EXP_AVG_SQ)
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
    """Where expert state lives. host_cache_bytes bounds the disk tier's RAM cache (None: an
    eighth of the expert state, at most a quarter of the available RAM, at least 2 records)."""

    tier: str = "host"
    directory: str | None = None
    host_cache_bytes: int | None = None
    pin_memory: bool = False
    shared_memory: bool = False
    io_threads: int = 4
    direct_io: bool = True    # False: buffered I/O + posix_fadvise(DONTNEED) (as on tmpfs)

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r} is unknown; use one of {', '.join(TIERS)}")
        if self.tier == "disk":
            if self.directory is None:
                raise ValueError("tier='disk' needs directory=<an existing writable directory "
                                 "for the expert files>")
            if self.host_cache_bytes is not None and self.host_cache_bytes < 1:
                raise ValueError(f"host_cache_bytes={self.host_cache_bytes!r}: the disk tier "
                                 "needs a positive host cache size in bytes (e.g. 1 << 30), "
                                 "or None for the default")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads!r} must be >= 1")


class ExpertRecord:
    """One expert's state: rows MASTER, GRAD, EXP_AVG, EXP_AVG_SQ (fp32 [P] each); step_t;
    on the host tier also `data_4P`, the [4, P] view of the rows."""

    def __init__(self, key: Key, rows: Sequence[torch.Tensor], step_t: torch.Tensor,
                 data_4P: torch.Tensor | None = None) -> None:
        self.key, self.rows, self.step_t, self.data_4P = key, list(rows), step_t, data_4P

    @property
    def master_P(self) -> torch.Tensor:
        return self.rows[MASTER]

    @property
    def grad_P(self) -> torch.Tensor:
        return self.rows[GRAD]

    @property
    def exp_avg_P(self) -> torch.Tensor:
        return self.rows[EXP_AVG]

    @property
    def exp_avg_sq_P(self) -> torch.Tensor:
        return self.rows[EXP_AVG_SQ]


def check_directory(directory: str, need_bytes: int) -> None:
    """Raise a clear error unless `directory` exists, is writable and has need_bytes free.
    The probe is a fresh unnamed file (O_EXCL: it never follows or truncates a symlink)."""
    if not os.path.exists(directory):
        raise ValueError(f"directory={directory!r} does not exist; create it (mkdir -p) or "
                         "point the disk tier at an existing directory")
    if not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r} is not a directory; give a directory for "
                         "the expert files")
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".moescale-probe-") as f:
            f.write(b"0")
            f.flush()
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"the disk under {directory!r} is full; free space or "
                          "choose another directory for the disk tier") from err
        raise ValueError(f"directory={directory!r} is not writable ({err.strerror}); choose a "
                         "writable directory for the disk tier") from err
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"the disk tier needs {need_bytes} bytes "
                      f"({need_bytes / 2**30:.2f} GiB) under {directory!r} but only {free} "
                      f"bytes ({free / 2**30:.2f} GiB) are free; free space or choose another "
                      "directory")


def default_host_cache(record_bytes: int, total_bytes: int) -> int:
    """The disk tier's host cache when none is given: an eighth of the expert state, at most a
    quarter of the RAM available now, at least two records."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = total_bytes
    return max(2 * record_bytes, min(total_bytes // 8, available // 4))


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
        self._lock = threading.Lock()
        self.disk: DiskTier | None = None
        self._waits = threading.local()   # per thread: seconds blocked in disk-tier acquires
        self._disk_need = 0     # bytes of expert files announced (reserve_disk) or written
        self._dir_lock = None   # the disk tier's directory, owned (moescale/dir_lock.py)

    # ----------------------------------------------------------------- construction
    def reserve_disk(self, total_bytes: int) -> None:
        """Check once, before any file is written, that the disk tier's directory has room
        for `total_bytes` of expert files (the sum over every layer to come)."""
        if self.config.tier == "disk":
            check_directory(self.config.directory, total_bytes)
            self._disk_need = max(self._disk_need, total_bytes)

    def add_layer(self, layout: ExpertLayout, num_experts: int,
                  init: Callable[[int], torch.Tensor]) -> int:
        """Add a layer of experts whose masters are init(e) (flat [P]); returns its index."""
        layer = len(self.layouts)

        def master(e: int) -> torch.Tensor:
            master_P = init(e).detach().reshape(-1).to(torch.float32)
            if master_P.numel() != layout.numel:
                raise ValueError(f"init({e}) has {master_P.numel()} numbers; the layout wants "
                                 f"{layout.numel}")
            return master_P

        steps_E = torch.zeros(num_experts, dtype=torch.float32)
        if self.config.tier == "disk":
            self._add_disk_layer(layout, num_experts, master)
            self._register(layout, None, steps_E)
            return layer
        data_E4P = torch.zeros(num_experts, 4, layout.numel, dtype=torch.float32)
        if self.config.shared_memory:
            data_E4P.share_memory_()
            steps_E.share_memory_()
            if self.config.pin_memory:  # pin the shared pages in place (no copy)
                torch.cuda.cudart().cudaHostRegister(
                    data_E4P.data_ptr(), data_E4P.numel() * data_E4P.element_size(), 0)
        elif self.config.pin_memory:
            data_E4P = data_E4P.pin_memory()
        for e in range(num_experts):
            data_E4P[e, MASTER].copy_(master(e))
        self._register(layout, data_E4P, steps_E)
        return layer

    def _add_disk_layer(self, layout: ExpertLayout, num_experts: int, master) -> None:
        if self.disk is None:
            cache = self.config.host_cache_bytes
            self.disk = DiskTier(self.config.directory, cache or 0, self.config.io_threads,
                                 self.config.pin_memory, direct_io=self.config.direct_io)
        record = 4 * align_up(4 * layout.numel)
        cache = self.disk.host_cache_bytes
        if cache and 2 * record > cache:
            raise ValueError(
                f"host_cache_bytes={cache} holds fewer than two expert records of {record} "
                f"bytes each; raise it to at least {2 * record}")
        written = sum(self.disk.record_bytes(lay) * n
                      for lay, n in enumerate(self.num_experts))
        need = written + record * num_experts
        check_directory(self.config.directory, max(0, max(need, self._disk_need) - written))
        self._disk_need = max(self._disk_need, need)
        if self._dir_lock is None:     # this store owns the directory while it is open
            self._dir_lock = claim_directory(
                self.config.directory, f"the disk tier's directory {self.config.directory!r}",
                "give each run its own offload.directory")
        layer = len(self.layouts)
        if os.path.islink(self.disk._layer_dir(layer)):    # its files would be deleted there
            raise ValueError(f"{self.disk._layer_dir(layer)!r} is a symbolic link; the disk "
                             "tier never follows one where it deletes and writes: remove it")
        try:
            self.disk.add_layer(layout.numel, num_experts, master)
        except BaseException:   # leave nothing behind: a half-written layer is useless
            shutil.rmtree(self.disk._layer_dir(layer), ignore_errors=True)
            raise
        if layer == 0 and not self.disk.io.direct and self.config.direct_io:
            warnings.warn(f"the filesystem of {self.config.directory!r} refuses O_DIRECT "
                          "(tmpfs?): the disk tier uses buffered I/O with "
                          "posix_fadvise(DONTNEED) there", RuntimeWarning, stacklevel=4)

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

    @classmethod
    def attach_disk(cls, config: StoreConfig, layouts: Sequence[ExpertLayout],
                    sums: dict[Key, dict[int, list[int]]]) -> "ExpertStore":
        """A disk-tier store over the files another process of this machine wrote into
        `config.directory` (its add_layer calls, generation 0): the same layouts and the chunk
        sums it recorded (`disk.sums`); nothing is written. Each process caches records in its
        own host slots: a caller sharing the files keeps them coherent (shared_store/node_disk.py)."""
        if config.tier != "disk":
            raise ValueError(f"attach_disk needs tier='disk', not {config.tier!r}")
        store = cls(config)
        store.disk = DiskTier(config.directory, config.host_cache_bytes or 0, config.io_threads,
                              config.pin_memory, direct_io=config.direct_io)
        for layer, layout in enumerate(layouts):
            num = sum(1 for key in sums if key[0] == layer)
            store.disk.numels.append(layout.numel)
            for e in range(num):
                store.disk.gen[(layer, e)] = 0
                store.disk.sums[(layer, e)] = {int(p): list(c) for p, c in
                                               sums[(layer, e)].items()}
            store._register(layout, None, torch.zeros(num, dtype=torch.float32))
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

    def state_bytes(self) -> int:
        """fp32 bytes of every expert's master, gradient and moments."""
        return sum(lay.record_bytes() * n for lay, n in zip(self.layouts, self.num_experts))

    # ----------------------------------------------------------------- access
    def acquire(self, key: Key, rows: int = ALL) -> ExpertRecord:
        """The record of `key`, pinned until `release(key)`. On the disk tier only `rows` (a
        mask of records.M | A | S | G) are guaranteed loaded (blocks on reads)."""
        if self.config.tier == "host":
            layer, e = key
            data_4P = self._host[layer][e]
            return ExpertRecord(key, data_4P.unbind(0), self._steps[key], data_4P)
        self._ensure_disk_cache()
        start = time.perf_counter()
        entry = self.disk.acquire(key, rows)
        self._waits.seconds = self.thread_read_wait_s() + time.perf_counter() - start
        views = [self.disk.row_view(entry, pos) for pos in LOGICAL_POS]
        return ExpertRecord(key, views, self._steps[key])

    def thread_read_wait_s(self) -> float:
        """Seconds the calling thread has spent in disk-tier acquires (waiting for a cache slot
        and the record's read; a cached record costs microseconds); 0.0 on the host tier."""
        return getattr(self._waits, "seconds", 0.0)

    def _ensure_disk_cache(self) -> None:
        if not self.disk.host_cache_bytes:   # the default: decided once every layer is known
            record = max(self.disk.record_bytes(lay) for lay in range(len(self.layouts)))
            self.disk.host_cache_bytes = default_host_cache(record, self.state_bytes())

    def read_master(self, key: Key) -> tuple[torch.Tensor, Callable[[], None]]:
        """(master_P, done): the expert's fp32 master for an upload (on the disk tier only the
        master row is read when the record is not cached); call done() once the copy is made.
        The caller has waited for the expert's step fence, so the master is current."""
        rec = self.acquire(key, records.M)
        return rec.master_P, lambda: self.release(key)

    def read_record(self, key: Key) -> tuple[torch.Tensor, float]:
        """A copy of one expert's record [4, P] (master, grad, moments) and its step count."""
        rec = self.acquire(key)
        try:
            return torch.stack(rec.rows), float(rec.step_t)
        finally:
            self.release(key)

    def release(self, key: Key, dirty: bool = False, rows: int = ALL,
                grad_zero: bool = False) -> None:
        """Unpin key's record; dirty: `rows` were modified; grad_zero: the gradient
        accumulator is zero now (an optimizer step), so it need not be persisted."""
        if self.config.tier == "host":
            return
        self.disk.release(key, rows if dirty else 0, grad_zero)

    def step_of(self, key: Key) -> float:
        return float(self._steps[key])

    def set_step(self, key: Key, step: float) -> None:
        self._steps[key].fill_(step)

    def bump_version(self, key: Key) -> None:
        with self._lock:
            self.versions[key] += 1

    # ----------------------------------------------------------------- disk-tier schedule
    def set_upcoming(self, accesses: Sequence[tuple[Key, int]], keep=None) -> None:
        """The expected order of the next accesses, (key, rows) each (for eviction and
        read-ahead). Pending accesses of the old list for which keep(key) is true (work
        already queued) stay in front."""
        if self.config.tier != "disk":
            return
        self._ensure_disk_cache()
        kept = [a for a in self.disk.pending_accesses() if keep(a[0])] \
            if keep is not None else []
        self.disk.set_upcoming(kept + list(accesses))

    def skip_access(self, key: Key) -> None:
        """One access of key that set_upcoming announced will not happen (the device cache
        reused its copy instead of reading the master again)."""
        if self.config.tier == "disk":
            self.disk.skip(key)

    def flush(self) -> None:
        """Write every dirty cached record back to its file (and wait)."""
        if self.disk is not None:
            self.disk.flush()

    def drop_cache(self) -> None:
        """Write back and drop every unpinned cached record (frees the host cache)."""
        if self.disk is not None:
            self.disk.flush(drop=True)

    def cache_bytes(self) -> int:
        return 0 if self.disk is None else self.disk.cache_bytes()

    @property
    def bytes_read(self) -> int:
        return 0 if self.disk is None else self.disk.bytes_read

    @property
    def bytes_written(self) -> int:
        return 0 if self.disk is None else self.disk.bytes_written

    @property
    def peak_cache_bytes(self) -> int:
        return 0 if self.disk is None else self.disk.peak_cache_bytes

    def path(self, key: Key) -> str:
        """The disk tier's current file of an expert."""
        return self.disk.path(key)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self._dir_lock is not None:
            self._dir_lock.release()
