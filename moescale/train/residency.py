"""Where a run's experts live: resident on the device, or offloaded to an ExpertStore.

The second library call that prepares the model (moescale/train/assembly.py), after the
exchange: `Resident` leaves the experts as parameters (the dense optimizer steps them; its
step handle only clips); `Offloaded` (`offload.tier` host | pin | disk | auto) moves each
rank's experts (all of them, or its expert-parallel shard) into that rank's own ExpertStore
with `offload_moe`, *before* the dense optimizer is built, so AdamW only sees dense
parameters. Its step handle (`OffloadStep`) follows the dense optimizer's learning rate, is
told which micro-batch is the last one, clips by the global norm over dense and expert
gradients (summed over the expert-parallel group when there is one) and steps the experts on
the host. The disk tier builds the experts on the meta device (`expert_device`), so they go
straight to their files, and refuses at start when the disk cannot hold them and the
checkpoints that stop sharing them.

Each rank's store (disk tier) lives under `<offload.directory or run_dir/expert-store>`, in
`rank<r>/` on a multi-process run. Under dynamic placement the residency is the node's shared
store streamed through each rank's device (`DynamicOffload`, shared_store/residency.py).
Checkpoints (each rank's experts in its own shard) are run_state.py's.

A residency of the caller's own (`Trainer(config, run_dir, residency=...)`,
`train_distributed(..., residency=...)`) replaces the one `[offload]` would pick:
`custom_residency` takes an object meeting parts.py's `Residency`, a factory called with the
run config, or the string "package.module:name" / "path/to/file.py:name" naming either (a
string survives process spawn: each rank imports it). docs/architecture.md, "A new residency".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import os
import shutil
from pathlib import Path

import torch

from moescale.expert_step import ResidentStep
from moescale.layers.moe import MoE
from moescale.offload import offload_moe
from moescale.sizes import fmt_bytes
from moescale.offload.records import POS_GRAD
from moescale.offload.state_format import RecordGeometry
from moescale.offload.stepping import OffloadStep, dir_bytes
from moescale.offload.store import default_host_cache
from moescale.train.config import RunConfig
from moescale.train.parts import Residency


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _local_experts(moe: MoE) -> int:
    """The experts this rank holds of a layer (an expert-parallel shard holds its own)."""
    return max(1, len(moe.experts.expert_ids))


def shard_role_of(exchange) -> tuple[bool, None]:
    """A rank's own experts: one data-parallel replica of them writes (residency's shard_role)."""
    groups = exchange.groups
    return groups is None or groups.dp_rank == 0, None


class Resident:
    """Every expert a parameter of the model, on the device (`config`: unused, so that the
    class is a factory for `residency=`)."""

    engine = None
    streams_experts = False

    def __init__(self, config: RunConfig | None = None) -> None:
        pass

    def expert_device(self) -> str | None:
        return None

    def prepare(self, model, exchange) -> ResidentStep:
        groups = exchange.groups
        for moe in _moes(model):
            if groups is not None and groups.ep_size > 1 and \
                    len(moe.experts.expert_ids) == moe.num_experts:
                raise ValueError(
                    f"resident experts with every expert on each of the {groups.ep_size} ranks "
                    "that place them (dynamic placement): the dense optimizer would average "
                    "their partial gradients, which must be summed; leave residency= out (the "
                    "node's shared store) or give a residency that sums them")
        return ResidentStep(groups)

    def shard_role(self, exchange) -> tuple[bool, None]:
        return shard_role_of(exchange)

    def describe(self, device, where: str) -> tuple[str, str]:
        if where:
            return "device-only", f"device-only, {where} on {device}"
        return "device-only", f"device-only (every expert resident on {device})"

    def close(self) -> None:
        pass


class Offloaded:
    """This rank's experts in its own ExpertStore, streamed through a device budget."""

    streams_experts = True

    def __init__(self, config: RunConfig, run_dir: Path, ranks) -> None:
        oc = config.offload
        self.config, self.run_dir, self.ranks = config, run_dir, ranks
        self.disk_dir = Path(oc.directory) if oc.directory else run_dir / "expert-store"
        if ranks.world_size > 1:
            self.disk_dir = self.disk_dir / f"rank{ranks.rank}"
            if oc.tier == "disk":
                self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.engine = None
        self.pick = None
        self.estimates = None

    def expert_device(self) -> str | None:
        """The disk tier's experts of one process are built on the meta device: they go
        straight to their files (initialised one at a time), never to RAM. (An expert-parallel
        rank builds the layer, keeps its shard and offloads it.)"""
        local = self.ranks.world_size == 1
        return "meta" if self.config.offload.tier == "disk" and local else None

    def _offload_config(self, model):
        """The run's [offload] section (the library's OffloadConfig) with what the run derives:
        device, precision, the directory, a default budget and host cache, the planner's batch."""
        oc, tc = self.config.offload, self.config.train
        device = "auto" if tc.device == "auto" else tc.device.partition(":")[0]
        changes = dict(device=device, compute_dtype=PRECISION_DTYPES[tc.precision],
                       seed=tc.seed)
        if oc.tier != "auto" and oc.device_budget_bytes is None \
                and oc.device_budget_experts is None:
            changes["device_budget_experts"] = 3.0   # double-buffered uploads, fwd and bwd
        if oc.tier in ("disk", "auto"):
            if not oc.directory:
                self.disk_dir.mkdir(parents=True, exist_ok=True)
            changes["directory"] = str(self.disk_dir)
        if oc.tier == "disk" and oc.host_cache_bytes is None:
            record = max(RecordGeometry(oc.state, sum(p.numel() for p in m.experts.parameters())
                                        // _local_experts(m)).total
                         for m in _moes(model))   # as stored
            total = sum(int((oc.state.state_bytes_per_param() + 4) * sum(
                p.numel() for p in m.experts.parameters())) for m in _moes(model))
            changes["host_cache_bytes"] = default_host_cache(record, total)
        if oc.tier == "auto":
            changes["tokens_per_micro_batch"] = tc.batch_size * tc.seq_len
        return dataclasses.replace(oc, **changes)

    def prepare(self, model, exchange):
        """Offload the (exchanged) model's experts; returns the step handle."""
        cfg = self._offload_config(model)
        meta = any(p.is_meta for p in model.parameters())
        if cfg.tier == "disk":
            self._check_disk_room(model)
        try:
            self.engine = offload_moe(model, cfg,
                                      expert_init=model.expert_init if meta else None)
        except ValueError as err:
            raise ValueError(f"offload.tier={self.config.offload.tier!r}: {err}") from None
        if self.engine.plan is not None:    # the planner's pick for tier="auto"
            self.estimates, self.pick = self.engine.plan
        reduce = None
        if exchange.groups is not None:     # disjoint shards: the norm sums over the EP group
            group = exchange.groups.ep_group
            reduce = lambda sq: self.ranks.all_reduce(   # noqa: E731
                sq.reshape(1), group=group, what="expert grad-norm all-reduce")[0]
        return OffloadStep(self.engine, reduce)

    def _check_disk_room(self, model) -> None:
        """Refuse at start when the disk cannot hold the expert files and the checkpoints that
        stop sharing them. A disk-tier checkpoint hard-links the store's files; the steps after
        it write new ones, so each kept checkpoint of a periodic series holds a full copy
        (one at the end only, hard-linked, costs nothing)."""
        tc = self.config.train
        if not self.disk_dir.is_dir():
            return   # the store names the missing directory itself
        state = 0
        for m in _moes(model):
            local = _local_experts(m)
            numel = sum(p.numel() for p in m.experts.parameters()) // local
            state += RecordGeometry(self.config.offload.state, numel).offsets[POS_GRAD] * local
        periodic = 0 < tc.checkpoint_interval < tc.steps
        copies = tc.keep_last if periodic else 0
        ckpt_dir = self.run_dir / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        same_fs = os.stat(ckpt_dir).st_dev == os.stat(self.disk_dir).st_dev
        stale = dir_bytes(self.disk_dir)   # a previous run's files, replaced at start
        needs = [(self.disk_dir, state * (1 + copies) if same_fs else state, stale)]
        if not same_fs:   # checkpoints are then copies, each a full one
            needs.append((ckpt_dir, state * max(1, tc.keep_last), 0))
        for where, need, reusable in needs:
            free = shutil.disk_usage(where).free + reusable
            if free < need:
                raise ValueError(
                    f"offload.tier='disk' needs {fmt_bytes(need)} under {str(where)!r} "
                    f"(expert state {fmt_bytes(state)}"
                    f"{f' x (1 + train.keep_last={copies})' if copies and same_fs else ''}) but "
                    f"{fmt_bytes(free)} are free; set train.checkpoint_interval 0 (one "
                    "checkpoint at the end, hard-linked: no extra space), lower train.keep_last, "
                    "or free space")

    def shard_role(self, exchange) -> tuple[bool, None]:
        return shard_role_of(exchange)

    def describe(self, device, where: str) -> tuple[str, str]:
        name, text = self._describe()
        return name, f"{text}; {where}" if where else text

    def _describe(self) -> tuple[str, str]:
        cfg, store = self.engine.config, self.engine.store
        budget = self.engine.device_budget_bytes
        itemsize = torch.empty((), dtype=self.engine.dtype).element_size()
        expert = max(lay.numel for lay in store.layouts) * itemsize
        where = {"host": "host RAM", "disk": f"disk ({cfg.directory}, host cache "
                 f"{fmt_bytes(store.config.host_cache_bytes or 0)})"}[cfg.store_tier]
        shown = "unbounded" if budget is None else \
            f"{fmt_bytes(budget)} = {budget / expert:.1f} experts"
        text = (f"experts in {where}, device budget {shown}"
                f", {cfg.step_mode} steps, activations {cfg.activation_policy}"
                + (f", hottest {cfg.pinned_share:.0%} pinned" if cfg.pinned_share else ""))
        if self.pick is None:
            return self.config.offload.tier, text
        predicted = "; ".join(f"{e.mode} {e.step_s:.3g} s{'' if e.fits else ' (no fit)'}"
                              for e in self.estimates)
        runs = {"device": "runs as the host tier with every expert's compute copy pinned on the "
                          "device (their master weights and AdamW state stay in host RAM, "
                          "stepped by the host optimizer: no device AdamW)",
                "pin": "runs as the host tier with the hottest 25% pinned on the device"
                }.get(self.pick, f"runs as the {cfg.store_tier} tier")
        return f"auto:{self.pick}", (f"auto -> planner picked '{self.pick}' (predicted step: "
                                     f"{predicted}); {runs}: {text}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def check_residency(config: RunConfig) -> None:
    """The residency's own refusals of options it cannot serve (before any process or thread
    starts)."""
    oc, pc = config.offload, config.parallel
    if oc.tier == "device-only":
        return
    if oc.step_mode == "eager" and config.optim.grad_clip > 0:
        raise ValueError(f"offload.step_mode='eager' steps experts during backward, before the "
                         f"global gradient norm is known, so optim.grad_clip="
                         f"{config.optim.grad_clip} cannot apply; use offload.step_mode "
                         "deferred or optim.grad_clip 0")
    if oc.tier == "auto" and oc.device_budget_bytes is None:
        raise ValueError("offload.tier='auto' needs offload.device_budget_bytes (e.g. '256MiB'): "
                         "the planner picks the fastest mode that fits it")
    if oc.tier == "auto" and pc.ep_size > 1:
        raise ValueError(f"offload.tier='auto' with parallel.ep_size={pc.ep_size} is not "
                         "supported: the planner plans one process's experts; choose "
                         "offload.tier host, pin or disk and a device budget per rank "
                         "(offload.device_budget_experts)")
    if pc.reuse in ("S1", "S3"):
        raise ValueError(f"offload.tier={oc.tier!r} with parallel.reuse={pc.reuse!r} is not "
                         "supported: S1 and S3 offload the hidden activation of resident "
                         "grouped weights; offloaded experts are pipelined with reuse none, S2, "
                         "S4 or auto")
    if pc.placement == "dynamic" and oc.tier not in ("host", "disk"):
        raise ValueError(f"parallel.placement='dynamic' with offload.tier={oc.tier!r} is not "
                         "supported: the node's shared store streams experts through each "
                         "rank's device from host memory or disk, without pinning or a planner; "
                         "use offload.tier host or disk, or offload.tier device-only")
    if pc.placement == "dynamic" and oc.activation_policy == "offload":
        raise ValueError("parallel.placement='dynamic' with offload.activation_policy="
                         "'offload' is not supported: the streamed shared-store experts keep "
                         "or recompute their hidden; use offload.activation_policy keep or "
                         "recompute")
    if pc.placement == "dynamic" and not oc.state.exact:
        raise ValueError(f"parallel.placement='dynamic' with offload.master={oc.master!r}, "
                         f"offload.moments={oc.moments!r} is not supported: the node's shared "
                         "store holds fp32 records; use fp32 master and moments")
    if pc.placement == "dynamic" and oc.step_mode == "eager":
        raise ValueError("parallel.placement='dynamic' with offload.step_mode='eager' is not "
                         "supported: each expert is stepped by its owner after backward, "
                         "between the node's barriers; use offload.step_mode deferred")


def _named(spec: str):
    """The object "package.module:name" or "path/to/file.py:name" names."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"residency={spec!r} must be 'package.module:name' or "
                         "'path/to/file.py:name' (a Residency or a factory taking the config)")
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(where).stem, where)
            if found is None or not Path(where).is_file():
                raise ImportError(f"no file {where!r}")
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as err:
        raise ValueError(f"residency={spec!r}: cannot import {where!r} ({err}); give an "
                         "importable module or an existing .py file") from None
    if not hasattr(module, name):
        raise ValueError(f"residency={spec!r}: {where!r} has no {name!r}")
    return getattr(module, name)


def custom_residency(spec, config: RunConfig):
    """The caller's residency (module docstring): `spec` is a Residency, a factory taking the
    config, or a string naming either."""
    if config.offload.tier != "device-only":
        raise ValueError(f"residency={spec!r} with offload.tier={config.offload.tier!r}: the "
                         "given residency decides where the experts live; leave offload.tier "
                         "device-only")
    found = _named(spec) if isinstance(spec, str) else spec
    factory = isinstance(found, type) or (callable(found) and not isinstance(found, Residency))
    made = found(config) if factory else found
    if not isinstance(made, Residency):
        raise ValueError(f"residency={spec!r} gave a {type(made).__name__}, which is not a "
                         "moescale.train.parts.Residency (it needs engine, streams_experts, "
                         "expert_device, prepare, shard_role, describe, close)")
    return made


def make_residency(config: RunConfig, run_dir: Path, ranks, exchange, custom=None):
    """The residency `config.offload` asks for; under dynamic placement the node's shared store
    (moescale.shared_store.residency): computed in place (device-only) or streamed through each
    rank's device (host, disk). `custom`: the caller's own (custom_residency), instead."""
    check_residency(config)
    if custom is not None:
        return custom_residency(custom, config)
    if config.parallel.placement == "dynamic":   # the node's shared store (shared_store/)
        from moescale.shared_store.residency import DynamicOffload, SharedResident

        oc = config.offload
        if oc.tier == "device-only":
            return SharedResident()
        root = Path(oc.directory) if oc.directory else run_dir / "expert-store"
        return DynamicOffload(tier=oc.tier, directory=str(root), mode=oc.tier,
                              device_budget_bytes=oc.device_budget_bytes,
                              device_budget_experts=oc.device_budget_experts,
                              host_cache_bytes=oc.host_cache_bytes,
                              activation_policy=oc.activation_policy, lookahead=oc.lookahead)
    if config.offload.tier == "device-only":
        return Resident()
    if ranks.world_size > 1 and exchange.groups.world_size != exchange.groups.ep_size:
        raise ValueError(f"offload.tier={config.offload.tier!r} with {ranks.world_size} "
                         f"processes and parallel.ep_size={exchange.groups.ep_size}: offloaded "
                         "expert shards are not replicated over data-parallel ranks; "
                         f"set parallel.ep_size {ranks.world_size} (one shard per rank)")
    return Offloaded(config, run_dir, ranks)
