"""Generation from a run of any size: its experts stay offloaded and stream per token.

    with open_run("runs/big", experts="disk", memory=2 << 30) as run:
        out_BS = run.model.generate(idx_BS, 100, temperature=0)

`open_run(RUN_DIR, experts=...)` loads a `moescale train` run's newest verified checkpoint (or
`step`) for generation, with its experts

- `resident`: parameters of the model (moescale.load_run), for runs that fit in memory;
- `host`: in a host-tier ExpertStore (fp32 records in RAM, streamed through the device cache);
- `disk`: in a disk-tier ExpertStore in a fresh directory inside RUN_DIR (removed on close;
  one a killed process left behind is removed by the next open_run of the run),
  filled from the checkpoint's expert shards: a disk-tier run's record files are adopted by
  hard link (no expert is copied or passes through memory), other runs' experts are written
  there one at a time. Each forward reads only the master rows of the experts its tokens route
  to that are not in the bounded host cache (the store's Belady/read-ahead cache), and the
  device cache uploads them one after another;
- `auto` (default): `disk` when `memory` is given, else the run's own residency (resident,
  host for host / pin / auto, disk for disk).

`memory` (bytes; `moescale generate --memory 2GiB`) bounds what the model holds in host memory:
the dense weights (fp32), the KV cache of `batch` sequences, three experts' device copies
(double-buffered uploads) and the disk tier's host cache, which gets the rest (at least two
experts; ValueError naming the shortfall otherwise). The interpreter and torch themselves
(~0.3-0.5 GiB of RSS) come on top; what loading freed is handed back to the kernel first
(`release_freed_memory`: glibc keeps freed heap memory otherwise). Generation reads only
master rows, so once loaded the host cache's slots hold masters alone
(`ExpertStore.set_slot_rows`): it caches (memory left) / (master bytes) experts.

On a CPU device with fp32 masters the walks compute from the cached master rows in place
(`DeviceCache.borrow`) instead of copying each into a "device" buffer first.

`generation_mode(engine)` does both for a training run's own end-of-run sample: while it
generates, the run's `host_cache_bytes` are slots of one master each (an fp32 record's four
rows made a slot four masters wide: 1 GiB held 13 records, fewer experts than one token of
moe-s routes to, and 56 masters now), and as for training again after.

Deliberately not here: the sampling loop and KV cache (GPT.generate), the measurement
(gen_stats.py), the store and caches themselves (moescale.offload).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moescale.layers.moe import MoE
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.records import ALL, POS_MASTER, M
from moescale.offload.state_format import RecordGeometry, StateFormat
from moescale.shared_store.node_store import owner_alive
from moescale.sizes import fmt_bytes
from moescale.train.load_run import load_run_offloaded, run_config

EXPERTS = ("auto", "resident", "host", "disk")
STORE_PREFIX = ".generate-store-"   # RUN_DIR/.generate-store-<pid>-<random>: a disk-tier store
DEVICE_EXPERTS = 3.0          # device copies: the one computing, the next, one more in flight


@dataclass
class MemoryPlan:
    """How `memory` bytes split between what generation holds (all in bytes)."""

    dense: int
    kv_cache: int
    device_copies: int
    host_cache: int          # masters the disk tier's cache holds, times their bytes
    master_bytes: int        # one expert's master row on disk (aligned, in the run's format)
    record_bytes: int        # one expert's whole record (a host-cache slot holds one)

    @property
    def cached_experts(self) -> int:
        return self.host_cache // self.master_bytes

    def describe(self) -> str:
        return (f"dense {fmt_bytes(self.dense)}, KV cache {fmt_bytes(self.kv_cache)}, device "
                f"copies {fmt_bytes(self.device_copies)}, host cache {fmt_bytes(self.host_cache)}"
                f" ({self.cached_experts} experts)")


@dataclass
class OpenRun:
    """A loaded run for generation: `model` (eval mode), `config`, the offload `engine`
    (None when resident); close() (or `with`) releases the store and its directory."""

    model: torch.nn.Module
    config: object
    experts: str
    engine: object = None
    directory: Path | None = None
    plan: MemoryPlan | None = None
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> "OpenRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale_stores(run_dir: str | Path) -> list[Path]:
    """Remove the generation stores in RUN_DIR whose process is gone (killed before its close:
    `.generate-store-<pid>-*`); returns them. Another live generation's store is left alone."""
    removed = []
    for path in Path(run_dir).glob(f"{STORE_PREFIX}*"):
        pid = path.name[len(STORE_PREFIX):].split("-")[0]
        if pid.isdigit() and not owner_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def release_freed_memory() -> None:
    """Hand the heap memory that loading freed back to the kernel (glibc's malloc_trim), so
    that generation's RSS starts from what the model holds; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_experts(experts: str, memory: int | None, run_tier: str) -> str:
    """The residency `auto` stands for (see the module docstring)."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r} is unknown; use one of {', '.join(EXPERTS)}")
    if memory is not None and experts in ("resident", "host"):
        raise ValueError(f"memory={memory} bounds the disk tier's host cache; with "
                         f"experts={experts!r} every expert is in memory: drop --memory or use "
                         "--experts disk")
    if experts != "auto":
        return experts
    if memory is not None or run_tier == "disk":
        return "disk"
    return "resident" if run_tier == "device-only" else "host"


def memory_plan(model, memory: int, batch: int, state: StateFormat = StateFormat()
                ) -> MemoryPlan:
    """Split `memory` for a meta-device model (before its experts are offloaded) whose store
    keeps masters in `state`'s format."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_ids = {id(p) for m in moes for p in m.experts.parameters()}
    dense = 4 * sum(p.numel() for p in model.parameters() if id(p) not in expert_ids)
    cfg = model.config
    kv = 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.seq_len * cfg.head_dim * 4
    numel = max(sum(p.numel() for p in m.experts.parameters()) // m.num_experts for m in moes)
    geo = RecordGeometry(state, numel)
    master = geo.strides[POS_MASTER]
    device = int(DEVICE_EXPERTS * 4 * numel)
    left = memory - dense - kv - device
    if left < 2 * master:
        need = dense + kv + device + 2 * master
        raise ValueError(f"memory={memory} ({fmt_bytes(memory)}) is too small for this model: "
                         f"dense weights {fmt_bytes(dense)}, KV cache {fmt_bytes(kv)}, device "
                         f"copies {fmt_bytes(device)} and two cached experts of "
                         f"{fmt_bytes(master)} need {fmt_bytes(need, exact=True)}; raise "
                         "--memory")
    return MemoryPlan(dense=dense, kv_cache=kv, device_copies=device,
                      host_cache=left // master * master, master_bytes=master,
                      record_bytes=geo.total)


def open_run(run_dir: str | Path, *, experts: str = "auto", memory: int | None = None,
             step: int | None = None, device: str | torch.device = "cpu", batch: int = 1
             ) -> OpenRun:
    """Load RUN_DIR for generation with its experts resident, on the host tier or streamed
    from the disk tier (see the module docstring)."""
    if memory is not None and (isinstance(memory, bool) or not memory >= 1):
        raise ValueError(f"memory={memory!r} must be a positive number of bytes (e.g. 2 << 30)")
    if batch < 1:
        raise ValueError(f"batch={batch!r} must be >= 1")
    config = run_config(run_dir)
    where = GENERATION[resolve_experts(experts, memory, config.offload.tier)]
    return where.open(run_dir, config, step, torch.device(device), memory, batch)


class ResidentGeneration:
    """`experts="resident"`: the experts parameters of the model (moescale.load_run)."""

    name = "resident"

    def open(self, run_dir, config, step, device, memory, batch) -> OpenRun:
        model, config, _ = load_run_offloaded(run_dir, step, device, None)
        release_freed_memory()
        return OpenRun(model, config, self.name)


class HostGeneration:
    """`experts="host"`: a host-tier ExpertStore filled from the checkpoint's shards."""

    name = "host"

    def store_options(self, run_dir, model, state_format, memory, batch, state: dict) -> dict:
        """The OffloadConfig fields of this tier beyond the common ones (`state` keeps what
        open() needs after loading: "plan", "directory")."""
        return {}

    def open(self, run_dir, config, step, device, memory, batch) -> OpenRun:
        state = {}

        def offload(model):
            state_format = config.offload.state      # the run's record format: masters as trained
            changes = dict(directory=None, master=state_format.master,
                           moments=state_format.moments)
            changes.update(self.store_options(run_dir, model, state_format, memory, batch,
                                              state))
            oc = OffloadConfig(tier=self.name, device=device.type,
                               device_budget_experts=DEVICE_EXPERTS, compute_dtype="float32",
                               reserve_disk=False, **changes)   # its records are adopted
            # masters are left zero (not written on disk): the checkpoint's shards fill them
            return offload_moe(model, oc, expert_init=lambda layer, e, layout: None)

        plan, engine = None, None
        try:
            model, config, engine = load_run_offloaded(run_dir, step, device, offload)
            plan = state.get("plan")     # generation reads masters: slots of one master each
            engine.store.set_slot_rows(M, plan.host_cache if plan is not None else None)
            engine.borrow_masters(True)
        except BaseException:
            if engine is not None:
                engine.close()
            if state.get("directory") is not None:
                shutil.rmtree(state["directory"], ignore_errors=True)
            raise
        release_freed_memory()
        return OpenRun(model, config, self.name, engine, state.get("directory"), plan)


class DiskGeneration(HostGeneration):
    """`experts="disk"`: a disk-tier ExpertStore in a fresh directory inside RUN_DIR, its host
    cache sized by `memory` (memory_plan)."""

    name = "disk"

    def store_options(self, run_dir, model, state_format, memory, batch, state: dict) -> dict:
        plan = memory_plan(model, memory, batch, state_format) if memory is not None else None
        state["plan"] = plan
        if state.get("directory") is None:
            remove_stale_stores(run_dir)
            try:
                state["directory"] = Path(tempfile.mkdtemp(
                    prefix=f"{STORE_PREFIX}{os.getpid()}-", dir=run_dir))
            except OSError as err:
                raise ValueError(f"cannot create the generation store in {str(run_dir)!r} "
                                 f"({err.strerror}); the disk tier needs a writable run "
                                 "directory (its checkpoint's records are linked there)")
        changes = dict(directory=str(state["directory"]))
        if plan is not None:     # whole-record slots while loading, master slots after
            changes["host_cache_bytes"] = max(plan.host_cache, 2 * plan.record_bytes)
        return changes


GENERATION = {g.name: g for g in (ResidentGeneration(), HostGeneration(), DiskGeneration())}


@contextlib.contextmanager
def generation_mode(engine):
    """While generating with a training run's engine (None: resident experts): its disk
    tier's host slots hold one master row each, not whole records (same bytes, about four
    times the experts cached), and walks borrow the masters where they can
    (`engine.borrow_masters`); as for training again afterwards."""
    if engine is None:
        yield
        return
    engine.store.set_slot_rows(M)
    engine.borrow_masters(True)
    try:
        yield
    finally:
        engine.borrow_masters(False)
        engine.store.set_slot_rows(ALL)


class NextLayerPrefetch:
    """Speculative read-ahead of the next MoE layer's experts (after mixtral-offloading): once
    MoE layer i has run, the next MoE layer's router is applied to layer i's input and the
    disk tier is told to read the experts it picks (`ExpertStore.set_upcoming`; reads start on
    the store's I/O threads while block i+1's attention runs). A wrong guess costs a read and
    a cache slot. `predicted` / `correct` count guessed experts and those the layer then used.
    An evaluation (`moescale bench generate --prefetch`); `close()` removes the hooks."""

    def __init__(self, model, engine) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.store = engine.store
        self.predicted = self.correct = 0
        self._guess: dict[int, set[int]] = {}
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.moes)]

    def _hook(self, i: int):
        def hook(module, args, output) -> None:
            guess = self._guess.pop(i, None)
            if guess is not None and module.last_stats is not None:
                used = set(torch.nonzero(module.last_stats.routed_E).flatten().tolist())
                self.correct += len(guess & used)
            if i + 1 == len(self.moes):
                return
            nxt = self.moes[i + 1]
            with torch.no_grad():
                ids = nxt.router(args[0].reshape(-1, nxt.config.d_model)).expert_ids_TK
            guess = set(ids.flatten().tolist())
            self._guess[i + 1] = guess
            self.predicted += len(guess)
            layer = nxt.experts.layer_index
            self.store.set_upcoming([((layer, e), M) for e in sorted(guess)],
                                    keep=lambda key: True)
        return hook

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
