"""How `moescale train` runs its model: on one process, with offloaded experts, or expert-parallel.

The Trainer (trainer.py) owns the loop; a backend owns what differs between these set-ups:

- `LocalBackend`: every expert resident on the device; torch's global-norm clipping.
- `OffloadBackend` (`offload.mode` host | pin | disk | auto): `offload_moe` moves the experts
  into an ExpertStore (host RAM or one file per expert on disk) before the dense optimizer is
  built, so AdamW only sees dense parameters; the engine follows its learning rate (the
  schedule), is told which micro-batch is the last one, clips by the global norm over dense and
  expert gradients (deferred step mode) and steps the experts. A checkpoint's store is written
  atomically (by the engine) into `checkpoints/store_<step>/` *before* the dense checkpoint, which
  is the commit point; stores of checkpoints no longer kept are removed. The summary gets the
  simulated (or CUDA) device's peak, the store's disk bytes and the plan (the planner's pick for
  `auto`).
- `ExpertParallelBackend` (`parallel.ep_size` > 1, or any multi-process launch,
  ep_backend.py): experts split over the expert-parallel group, each rank a slice of
  the rows, consolidated checkpoints.
- `ExpertParallelOffloadBackend` (`parallel.ep_size` > 1 with `offload.mode` host | pin | disk,
  ep_offload_backend.py): static EP whose local experts each rank offloads into its own store.
- `DynamicPlacementBackend` (`parallel.placement dynamic`, dynamic_backend.py): one host copy of
  the experts shared by the local ranks, LPT placement (+ splitting) every iteration.

`train_distributed(config, world_size)` is the Python-API twin of
`torchrun --nproc-per-node N -m moescale train ...` (real processes via `run_local`; gloo for
dynamic placement).

Deliberately not here: offloading combined with dynamic placement (refused by
`RunConfig.check_supported`), the loop itself, checkpoint file formats.

Legend: B batch rows, S sequence, W world size.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from moescale.offload.direct_io import align_up
from moescale.offload.store import default_host_cache
from moescale.train.checkpoint import list_checkpoints
from moescale.train.config import RunConfig, parse_bytes

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def check_rows(config: RunConfig, world: int) -> None:
    """Each of the `world` ranks takes an equal slice of a batch's rows."""
    if config.train.batch_size % world:
        raise ValueError(f"train.batch_size={config.train.batch_size} is not divisible by "
                         f"the {world} ranks; each rank takes an equal slice of the rows")


class LocalBackend:
    """One process, every expert resident on the device."""

    rank, world_size, writer = 0, 1, True

    def expert_device(self) -> str | None:
        """Where the model's stacked experts are built ("meta": nowhere; None: with the rest)."""
        return None

    def prepare(self, model: torch.nn.Module) -> None:
        """Called after the model is built (and, but for experts on the meta device, moved to
        its device), before the optimizer."""

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Called with the dense optimizer once it exists."""

    def shard(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor):
        return idx_BS, targets_BS

    def begin_micro_batch(self, last: bool) -> None:
        pass

    def clip(self, model: torch.nn.Module, max_norm: float) -> float | None:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def step_experts(self) -> None:
        """Called just before the dense optimizer steps."""

    def before_backward(self, loss: torch.Tensor) -> None:
        """Called with each micro-batch's loss before its backward."""

    def expert_skips(self) -> int:
        """Expert steps this rank's host optimizer refused so far (non-finite gradients)."""
        return 0

    def skip_step(self) -> None:
        """Called instead of step_experts when the step guard skips the step: discard this
        step's expert gradients (the trainer discards the dense ones)."""

    def step_metrics(self, model, counts_LE: list[list[int]]) -> dict:
        """Extra numbers for the step's metrics record (counts_LE: the step's routed tokens
        per expert of every MoE layer, over all ranks)."""
        return {}

    # reductions over ranks (identity here)
    def mean(self, values: list[float]) -> list[float]:
        return values

    def sum_counts(self, counts: list[torch.Tensor]) -> list[torch.Tensor]:
        return counts

    def any(self, flag: bool) -> bool:
        return flag

    def agree(self, value):
        return value

    def barrier(self) -> None:
        pass

    # checkpoints
    def model_state(self, model) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def load_model_state(self, model, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)

    def optimizer_tensors(self, optimizer, tensors: dict[str, torch.Tensor]):
        return tensors

    def local_optimizer_tensors(self, optimizer, tensors: dict[str, torch.Tensor]):
        return tensors

    def optimizer_groups(self, rest: dict) -> dict:
        """The optimizer's param groups and scalars (optimizer_to_flat's rest) as saved."""
        return rest

    def local_optimizer_groups(self, rest: dict) -> dict:
        """The inverse of optimizer_groups, for this process's optimizer."""
        return rest

    def save_extra(self, ckpt_dir: Path, step: int) -> dict:
        return {}

    def load_extra(self, ckpt_dir: Path, state: dict) -> None:
        pass

    def after_save(self, ckpt_dir: Path) -> None:
        pass

    # summary
    def memory(self) -> dict:
        return {}

    def plan(self, device) -> tuple[str, str]:
        """(short name, one line for the summary)."""
        return "device-only", f"device-only (every expert resident on {device})"

    def close(self) -> None:
        pass


class OffloadBackend(LocalBackend):
    """Experts in an ExpertStore (host or disk tier), streamed through a device budget."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        oc = config.offload
        self.config, self.run_dir = config, run_dir
        self.disk_dir = Path(oc.disk_dir) if oc.disk_dir else run_dir / "expert-store"
        self.engine = None
        self.pick = None
        self.estimates = None
        self._held = False      # eager: a non-finite loss this step, no expert steps

    def _offload_config(self, model):
        from moescale.offload import OffloadConfig

        oc, tc = self.config.offload, self.config.train
        tier = {"pin": "host", "host": "host", "disk": "disk", "auto": "auto"}[oc.mode]
        device_bytes = parse_bytes(oc.device_budget, "offload.device_budget")
        experts = oc.device_budget_experts
        if device_bytes is None and experts is None and tier != "auto":
            experts = 3.0    # double-buffered uploads in forward and in backward
        kw = dict(tier=tier, compute_dtype=PRECISION_DTYPES[tc.precision],
                  activation_policy=oc.activation_policy, step_mode=oc.step_mode,
                  lookahead=oc.lookahead, device_budget_bytes=device_bytes,
                  device_budget_experts=experts,
                  pin_fraction=0.25 if oc.mode == "pin" else 0.0)
        host_cache = parse_bytes(oc.host_cache, "offload.host_cache")
        if tier in ("disk", "auto"):
            if not oc.disk_dir:
                self.disk_dir.mkdir(parents=True, exist_ok=True)
            kw["directory"] = str(self.disk_dir)
        if tier == "disk" and host_cache is None:
            record = max(16 * sum(p.numel() for p in m.experts.parameters()) //
                         max(1, getattr(m.experts, "num_local_experts", m.num_experts))
                         for m in self._moes(model))   # an EP shard holds its local experts
            total = sum(16 * sum(p.numel() for p in m.experts.parameters())
                        for m in self._moes(model))
            host_cache = default_host_cache(record, total)
        kw["host_cache_bytes"] = host_cache
        if tier == "auto":
            kw.update(tokens_per_micro_batch=tc.batch_size * tc.seq_len,
                      host_budget_bytes=parse_bytes(oc.host_budget, "offload.host_budget"),
                      rates=oc.rates)
        return OffloadConfig(**kw)

    @staticmethod
    def _moes(model):
        from moescale.layers.moe import MoE
        return [m for m in model.modules() if isinstance(m, MoE)]

    def expert_device(self) -> str | None:
        """The disk tier's experts are built on the meta device: they go straight to their
        files (initialised one at a time), never to RAM."""
        return "meta" if self.config.offload.mode == "disk" else None

    def prepare(self, model) -> None:
        from moescale.offload import offload_moe

        cfg = self._offload_config(model)
        meta = any(p.is_meta for p in model.parameters())
        if cfg.tier == "disk":
            self._check_disk_room(model)
        try:
            self.engine = offload_moe(model, cfg,
                                      expert_init=model.expert_init if meta else None)
        except ValueError as err:
            raise ValueError(f"offload.mode={self.config.offload.mode!r}: {err}") from None
        if self.engine.plan is not None:    # the planner's pick for tier="auto"
            self.estimates, self.pick = self.engine.plan

    def _check_disk_room(self, model) -> None:
        """Refuse at start when the disk cannot hold the expert files and the checkpoints that
        stop sharing them. A disk-tier checkpoint hard-links the store's files; the steps after
        it write new ones, so each kept checkpoint of a periodic series holds a full copy
        (one at the end only, hard-linked, costs nothing)."""
        tc = self.config.train
        if not self.disk_dir.is_dir():
            return   # the store names the missing directory itself
        state = 0
        for m in self._moes(model):   # an EP shard holds its local experts
            local = max(1, getattr(m.experts, "num_local_experts", m.num_experts))
            numel = sum(p.numel() for p in m.experts.parameters()) // local
            state += 4 * align_up(4 * numel) * local
        periodic = 0 < tc.checkpoint_interval < tc.steps
        copies = tc.keep_last if periodic else 0
        ckpt_dir = self.run_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        same_fs = os.stat(ckpt_dir).st_dev == os.stat(self.disk_dir).st_dev
        stale = _dir_bytes(self.disk_dir)   # a previous run's files, replaced at start
        needs = [(self.disk_dir, state * (1 + copies) if same_fs else state, stale)]
        if not same_fs:   # checkpoints are then copies, each a full one
            needs.append((ckpt_dir, state * max(1, tc.keep_last), 0))
        for where, need, reusable in needs:
            free = shutil.disk_usage(where).free + reusable
            if free < need:
                raise ValueError(
                    f"offload.mode='disk' needs {need / 2**30:.1f} GiB under {str(where)!r} "
                    f"(expert state {state / 2**30:.1f} GiB"
                    f"{f' x (1 + train.keep_last={copies})' if copies and same_fs else ''}) but "
                    f"{free / 2**30:.1f} GiB are free; set train.checkpoint_interval 0 (one "
                    "checkpoint at the end, hard-linked: no extra space), lower train.keep_last, "
                    "or free space")

    def attach(self, optimizer) -> None:
        self.engine.follow(optimizer)

    def load_model_state(self, model, state) -> None:
        """Strict, except for expert weights of offloaded layers (an expert-parallel offloaded
        run saves them in the model state too; the store holds them here)."""
        from moescale.offload.experts import OffloadedExpertsBase

        offloaded = {name for name, m in model.named_modules()
                     if isinstance(m, OffloadedExpertsBase)}
        model.load_state_dict({k: v for k, v in state.items()
                               if k.rpartition(".")[0] not in offloaded})

    def begin_micro_batch(self, last: bool) -> None:
        self.engine.begin_micro_batch(last=last and not self._held)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Eager mode: a non-finite loss holds this step's expert steps (the guard skips it)."""
        if self.engine.config.step_mode == "eager" and not bool(torch.isfinite(loss).all()):
            self._held = True
            self.engine.begin_micro_batch(last=False)

    def clip(self, model, max_norm: float) -> float | None:
        if self.engine.config.step_mode == "deferred":
            return self.engine.clip_grad_norm_(model.parameters(), max_norm)
        return None      # eager: experts stepped during backward (grad_clip is 0)

    def expert_skips(self) -> int:
        if self.engine.config.step_mode == "eager":
            self.engine.optimizer.wait_all()     # the steps queued during backward
        return self.engine.optimizer.skipped_steps

    def step_experts(self) -> None:
        self._held = False
        self.engine.step()

    def skip_step(self) -> None:
        self._held = False
        self.engine.skip_step()

    def _store_dir(self, ckpt_dir: Path, step: int) -> Path:
        return ckpt_dir / f"store_{step:08d}"

    def save_extra(self, ckpt_dir: Path, step: int) -> dict:
        target = self._store_dir(ckpt_dir, step)
        target.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(target), tag=f"{step:08d}")
        return {"expert_store": target.name}

    def load_extra(self, ckpt_dir: Path, state: dict, first_expert: int = 0,
                   total_experts: int | None = None) -> None:
        """Restore the store (an expert-parallel rank: its slice of a store of all experts)."""
        from moescale.offload.checkpoint import StoreCheckpointError

        name = state.get("expert_store")
        if name is None:
            raise ValueError(f"the checkpoint of step {state.get('step')} has no expert store; "
                             "it was written without offloading: resume with the run's "
                             "config.toml")
        if not re.fullmatch(r"store_\d{8}", str(name)) or not (ckpt_dir / name).is_dir():
            raise StoreCheckpointError(f"the expert store {str(name)[:100]!r} of the checkpoint "
                                       f"of step {state.get('step')} is missing under "
                                       f"{str(ckpt_dir)!r}; the checkpoint is incomplete")
        self.engine.load_checkpoint(str(ckpt_dir / name), first_expert, total_experts,
                                    tag=name[len("store_"):])

    def after_save(self, ckpt_dir: Path) -> None:
        kept = {f"store_{step:08d}" for step, _ in list_checkpoints(ckpt_dir)}
        for entry in ckpt_dir.iterdir():
            if entry.name.startswith("store_") and entry.name not in kept and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    def memory(self) -> dict:
        engine = self.engine
        engine.synchronize()
        out = {"device_peak_bytes": int(engine.device.peak_bytes),
               "device_budget_bytes": engine.device.budget_bytes}
        if engine.store.config.tier == "disk":
            out["disk_bytes"] = _dir_bytes(Path(engine.store.config.directory))
            out["disk_read_bytes"] = int(engine.store.bytes_read)
            out["disk_written_bytes"] = int(engine.store.bytes_written)
        return out

    def plan(self, device) -> tuple[str, str]:
        from moescale.offload.planner import fmt_bytes

        cfg, store = self.engine.config, self.engine.store
        budget = self.engine.device.budget_bytes
        itemsize = torch.empty((), dtype=self.engine.dtype).element_size()
        expert = max(lay.numel for lay in store.layouts) * itemsize
        where = {"host": "host RAM", "disk": f"disk ({cfg.directory}, host cache "
                 f"{fmt_bytes(store.config.host_cache_bytes or 0)})"}[cfg.tier]
        shown = "unbounded" if budget is None else \
            f"{fmt_bytes(budget)} = {budget / expert:.1f} experts"
        text = (f"experts in {where}, device budget {shown}"
                f", {cfg.step_mode} steps, activations {cfg.activation_policy}"
                + (f", hottest {cfg.pin_fraction:.0%} pinned" if cfg.pin_fraction else ""))
        if self.pick is None:
            return self.config.offload.mode, text
        predicted = "; ".join(f"{e.mode} {e.step_s:.3g} s{'' if e.fits else ' (no fit)'}"
                              for e in self.estimates)
        return f"auto:{self.pick}", (f"auto -> planner picked '{self.pick}' (predicted step: "
                                     f"{predicted}): {text}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def make_backend(config: RunConfig, run_dir: Path) -> LocalBackend:
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        import torch.distributed as dist
        multi = multi or (dist.is_available() and dist.is_initialized()
                          and dist.get_world_size() > 1)
    except ImportError:  # pragma: no cover
        pass
    if config.parallel.placement == "dynamic":
        from moescale.train.dynamic_backend import DynamicPlacementBackend
        return DynamicPlacementBackend(config)
    if config.parallel.ep_size > 1 or multi:
        if config.offload.mode != "device-only":
            from moescale.train.ep_offload_backend import ExpertParallelOffloadBackend
            return ExpertParallelOffloadBackend(config, run_dir)
        from moescale.train.ep_backend import ExpertParallelBackend
        return ExpertParallelBackend(config)
    if config.offload.mode != "device-only":
        return OffloadBackend(config, run_dir)
    return LocalBackend()


def _rank_main(rank: int, world_size: int, tree: dict, run_dir: str, quiet: bool,
               resume: bool):
    from moescale.train.config import load_config
    from moescale.train.trainer import Trainer

    config = load_config(None, None, base=tree)
    out = open(os.devnull, "w") if quiet or rank else None
    trainer = Trainer(config, run_dir, resume=resume, out=out, err=out)
    code = trainer.run()
    return code, getattr(trainer, "summary", None) if rank == 0 else None


def train_distributed(config: RunConfig, run_dir: str | Path, world_size: int, *,
                      resume: bool = False, quiet: bool = False, deadline_s: float = 3600.0):
    """Train `config` on `world_size` local processes (gloo on CPU, NCCL on GPU); returns
    (exit code, rank 0's summary). The Python twin of `torchrun --nproc-per-node N -m
    moescale train` (resume=True: `--resume run_dir`, with `config` as the full config)."""
    from moescale.parallel.launch import run_local
    from moescale.train.config import to_dict

    backend = "nccl" if torch.cuda.is_available() and config.parallel.placement == "static" \
        else "gloo"      # dynamic placement computes on the host copy
    results = run_local(_rank_main, world_size, (to_dict(config), str(run_dir), quiet, resume),
                        backend=backend, timeout_s=config.parallel.timeout_s,
                        deadline_s=deadline_s)
    return results[0].value
