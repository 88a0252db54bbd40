"""ExpertStore: the authoritative state of every (layer, expert) outside the device.

Each expert is one record of four rows: the master parameters (all of the expert's tensors
flattened into P numbers), the gradient accumulator, and AdamW's two moments, in fp32 or a
compact format (state_format.py: a bf16 master, bf16 or int8 moments; a compact host store
keeps an expert's gradient only from its backward to its step); plus its
optimizer step count (`step_t`, a scalar tensor as torch's AdamW wants) and a `version` bumped
by every optimizer step (device copies of an older version are stale); and its `origin`, the
xxh3-64 of the fp32 master it was built with (the run's identity: a checkpoint records it, so
that another run's checkpoint is not loaded silently; None for a blank or attached store).

Tiers (`store.tier`: a HostTier or a DiskTier, with the same methods, so that nothing here
asks which one it holds):
- `host` (host_tier.py): one `[E, 4, P]` tensor per layer in RAM, pinned under CUDA, optionally
  in shared memory (`share_memory_()`) so that several local ranks map one copy
  (`shared_state()` in the owner, `ExpertStore.attach(...)` in the others);
- `disk` (disk_tier.py, disk_setup.py, disk_writeback.py): one file per expert, moved by direct I/O through a fixed pool of host slots whose
  size (`host_cache_bytes`) is the tier's real host memory; reads ahead and writes behind from
  the schedule the layers announce (`set_upcoming`), Belady eviction; only the rows an access
  needs are read and a zero gradient accumulator is never persisted (disk_tier.py); every
  read is checked against the chunk sums recorded when the row was written (`verify_reads`).

Errors: a missing, non-directory or unwritable disk directory raises ValueError at
construction; too little free space for the files raises OSError(ENOSPC) before anything is
written (`reserve_disk` checks every layer at once); a write that fails later (disk full)
raises OSError naming the file; a read whose bytes do not match their recorded sums raises
`CorruptReadError` (an OSError) naming the layer, expert, file and byte offset, in the access
that needed them.

`thread_read_wait_s()`: the seconds the calling thread has blocked in disk-tier acquires (a
training step's own record reads, e.g. its gradient-norm pass; counted per thread, so the copy
and optimizer threads' reads are not the step's).

Deliberately not here: the optimizer math (optimizer.py), device copies (cache.py), atomic
checkpoints of the store (checkpoint.py), the tiers themselves (host_tier.py, disk_tier.py),
the plain types and directory checks (store_types.py, re-exported here).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

import torch
import xxhash

from moescale.offload import records
from moescale.offload.disk_tier import DiskTier
from moescale.offload.host_grads import HostGrads
from moescale.offload.host_tier import HostTier
from moescale.offload.records import ALL, STATE
from moescale.offload.state_format import RecordGeometry, StateCodec
from moescale.offload.store_types import (EXP_AVG, EXP_AVG_SQ, GRAD, LOGICAL_POS, MASTER, TIERS,
                                          ExpertLayout, ExpertRecord, Key, StoreConfig,
                                          check_directory, default_host_cache)

__all__ = ["EXP_AVG", "EXP_AVG_SQ", "GRAD", "LOGICAL_POS", "MASTER", "TIERS", "ExpertLayout",
           "ExpertRecord", "ExpertStore", "Key", "StoreConfig", "check_directory",
           "default_host_cache"]


class ExpertStore:
    """Per-(layer, expert) fp32 state on the host or on disk; thread-safe."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.format = config.state
        self.layouts: list[ExpertLayout] = []
        self.num_experts: list[int] = []
        self.first_expert: list[int] = []   # per layer: the global id of store expert 0 (an
                                            # expert-parallel shard's start; keys rounding)
        self._steps: dict[Key, torch.Tensor] = {}
        self._host_steps: list[torch.Tensor] = []     # [E] step counts per layer
        self.versions: dict[Key, int] = {}
        self._lock = threading.Lock()
        self.host_grads = HostGrads()   # compact host records' gradients (host_grads.py)
        # where the records live: HostTier or DiskTier, the same methods (host_tier.py)
        self.tier = DiskTier.for_store(config) if config.tier == "disk" else HostTier(
            config.state, self.host_grads, pin_memory=config.pin_memory,
            shared_memory=config.shared_memory)
        self.origins: dict[Key, str | None] = {}   # run identity: xxh3-64 of the initial
                                                   # fp32 master (None: blank or attached)

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, for what only files have (checkpoint links, a node's shared files,
        I/O figures); None on the host tier."""
        return self.tier if self.config.tier == "disk" else None

    @disk.setter
    def disk(self, tier: DiskTier) -> None:
        self.tier = tier

    @property
    def _host(self) -> list[torch.Tensor]:
        """The host tier's records per layer ([] on disk)."""
        return getattr(self.tier, "data", [])

    # ----------------------------------------------------------------- construction
    def reserve_disk(self, total_bytes: int) -> None:
        """Check once, before any file is written, that the disk tier's directory has room
        for `total_bytes` of expert files (the sum over every layer to come)."""
        self.tier.reserve(total_bytes)

    def add_layer(self, layout: ExpertLayout, num_experts: int,
                  init: Callable[[int], torch.Tensor]) -> int:
        """Add a layer of experts whose masters are init(e) (flat [P]; None: zero, and on the
        disk tier not written, for a caller that loads the real masters next); returns its
        index."""
        layer = len(self.layouts)

        def master(e: int) -> torch.Tensor | None:
            master_P = init(e)
            if master_P is None:         # disk tier: a zero master, not written (sparse)
                return None
            master_P = master_P.detach().reshape(-1).to(torch.float32)
            if master_P.numel() != layout.numel:
                raise ValueError(f"init({e}) has {master_P.numel()} numbers; the layout wants "
                                 f"{layout.numel}")
            self.origins[(layer, e)] = xxhash.xxh3_64_hexdigest(
                memoryview(master_P.cpu().contiguous().numpy()))
            return master_P

        steps_E = torch.zeros(num_experts, dtype=torch.float32)
        self.tier.add_experts(layout, num_experts, master, steps_E)
        self._register(layout, steps_E)
        return layer

    def shared_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (data_E4P, steps_E) of a host store in shared memory, to hand to other
        local processes (torch.multiprocessing pickles them as shared-memory handles)."""
        return list(zip(self.tier.shared_records(), self._host_steps))

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
            store.tier.attach_records(layout.numel, data_E4P)
            store._register(layout, steps_E)
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
        for layer, layout in enumerate(layouts):
            num = sum(1 for key in sums if key[0] == layer)
            store.tier.attach_files(layout, num, sums)
            store._register(layout, torch.zeros(num, dtype=torch.float32))
        return store

    def _register(self, layout: ExpertLayout, steps_E: torch.Tensor) -> None:
        """Append a layer of len(steps_E) experts (its records are the tier's): layout, step
        counts, versions."""
        layer = len(self.layouts)
        self.layouts.append(layout)
        self.num_experts.append(steps_E.numel())
        self.first_expert.append(0)
        self._host_steps.append(steps_E)
        for e in range(steps_E.numel()):
            self._steps[(layer, e)] = steps_E[e]  # a 0-dim view: AdamW increments it in place
            self.versions[(layer, e)] = 0
            self.origins.setdefault((layer, e), None)

    def keys(self) -> Iterable[Key]:
        for layer, n in enumerate(self.num_experts):
            for e in range(n):
                yield (layer, e)

    def state_bytes(self) -> int:
        """Bytes of every expert's master, gradient and moments in the store's format (a
        compact host store holds a gradient only from an expert's backward to its step)."""
        return sum(lay.record_bytes(self.format) * n
                   for lay, n in zip(self.layouts, self.num_experts))

    def host_bytes(self) -> int:
        """Bytes the host tier holds now: its records and the gradients alive or kept for reuse
        (0 on disk)."""
        return self.tier.host_bytes()

    def geometry(self, layer: int) -> RecordGeometry:
        """Where a record's rows lie (host-tier byte records: 64-byte rows; disk: 4 KiB)."""
        return self.tier.geometry(layer)

    # ----------------------------------------------------------------- access
    def acquire(self, key: Key, rows: int = ALL) -> ExpertRecord:
        """The record of `key`, pinned until `release(key)`. On the disk tier only `rows` (a
        mask of records.M | A | S | G) are guaranteed loaded (blocks on reads)."""
        return self.tier.record(key, rows, self._steps[key])

    def thread_read_wait_s(self) -> float:
        """Seconds the calling thread has spent in disk-tier acquires (waiting for a cache slot
        and the record's read; a cached record costs microseconds); 0.0 on the host tier."""
        return self.tier.thread_read_wait_s()

    def read_master(self, key: Key) -> tuple[torch.Tensor, Callable[[], None]]:
        """(master_P, done): the expert's fp32 master for an upload (on the disk tier only the
        master row is read when the record is not cached); call done() once the copy is made.
        The caller has waited for the expert's step fence, so the master is current."""
        rec = self.acquire(key, records.M)
        return rec.master_P, lambda: self.release(key)

    def read_record(self, key: Key) -> tuple[torch.Tensor, float]:
        """A copy of one expert's record [4, P] (master, grad, moments) as fp32, and its step
        count (compact formats decoded)."""
        rec = self.acquire(key, ALL if self.format.exact else STATE)
        try:
            if self.format.exact:
                return torch.stack(rec.rows), float(rec.step_t)
            master_P, exp_avg_P, exp_avg_sq_P = self._decode(rec)
            grad_P = rec.grad_P if rec.grad_P is not None else torch.zeros_like(master_P)
            return torch.stack([master_P, grad_P, exp_avg_P, exp_avg_sq_P]), float(rec.step_t)
        finally:
            self.release(key)

    def _decode(self, rec: ExpertRecord) -> tuple[torch.Tensor, ...]:
        """Fresh fp32 copies of a record's master and moments."""
        return StateCodec(self.format).decode_state(rec.master_P, rec.exp_avg_P, rec.exp_avg_sq_P,
                                                    self.layouts[rec.key[0]].numel)

    def get_state(self, key: Key) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 copies of an expert's master, exp_avg and exp_avg_sq (whatever the format)."""
        rec = self.acquire(key, STATE)
        try:
            return self._decode(rec)
        finally:
            self.release(key)

    def put_state(self, key: Key, master_P: torch.Tensor, exp_avg_P: torch.Tensor | None,
                  exp_avg_sq_P: torch.Tensor | None) -> None:
        """Set an expert's master and moments from fp32 [P] tensors (None: zero moments),
        encoded in the store's format (a bf16 master rounds to nearest); the gradient
        accumulator is zeroed. The caller sets the step count and bumps the version."""
        rec = self.acquire(key, STATE)
        try:
            StateCodec(self.format).encode_state(
                (rec.master_P, rec.exp_avg_P, rec.exp_avg_sq_P), master_P, exp_avg_P,
                exp_avg_sq_P, self.layouts[key[0]].numel)
        finally:     # the gradient accumulator: zero (the host tier drops it)
            self.release(key, dirty=True, rows=STATE, grad_zero=True)

    def release(self, key: Key, dirty: bool = False, rows: int = ALL,
                grad_zero: bool = False) -> None:
        """Unpin key's record; dirty: `rows` were modified; grad_zero: the gradient
        accumulator is zero now (an optimizer step), so it need not be persisted."""
        self.tier.release(key, rows if dirty else 0, grad_zero)

    def step_of(self, key: Key) -> float:
        return float(self._steps[key])

    def set_step(self, key: Key, step: float) -> None:
        self._steps[key].fill_(step)

    def bump_version(self, key: Key) -> None:
        with self._lock:
            self.versions[key] += 1

    # ----------------------------------------------------------------- the disk tier's schedule
    def set_upcoming(self, accesses: Sequence[tuple[Key, int]], keep=None) -> None:
        """The expected order of the next accesses, (key, rows) each (for eviction and
        read-ahead; nothing on the host tier). Pending accesses of the old list for which
        keep(key) is true (work already queued) stay in front."""
        self.tier.announce(accesses, keep)

    def skip_access(self, key: Key) -> None:
        """One access of key that set_upcoming announced will not happen (the device cache
        reused its copy instead of reading the master again)."""
        self.tier.skip(key)

    def flush(self) -> None:
        """Write every dirty cached record back to its file (and wait)."""
        self.tier.flush()

    def drop_cache(self) -> None:
        """Write back and drop every unpinned cached record (frees the host cache)."""
        self.tier.flush(drop=True)

    def set_slot_rows(self, rows: int, host_cache_bytes: int | None = None) -> None:
        """Size the disk tier's host slots for a record's leading rows `rows` (M: masters, all
        generation reads: ~4x the fp32 experts in the same bytes) in `host_cache_bytes` (default:
        as now), after a write-back and drop; other rows are then refused (ValueError)."""
        self.tier.set_slot_rows(rows, host_cache_bytes)

    def cache_bytes(self) -> int:
        return self.tier.cache_bytes()

    @property
    def bytes_read(self) -> int:
        return self.tier.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.tier.bytes_written

    @property
    def peak_cache_bytes(self) -> int:
        return self.tier.peak_cache_bytes

    def tier_memory(self) -> dict:
        """The disk tier's bytes: its files, read and written so far ({} on the host tier)."""
        return self.tier.memory()

    def path(self, key: Key) -> str:
        """The disk tier's current file of an expert."""
        return self.tier.path(key)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        self.tier.close()
