"""How a run exchanges tokens with its experts: on one process, expert-parallel, or placed per step.

The first of the two library calls that prepare the model (moescale/train/assembly.py): the
exchange shards the MoE layers over ranks (or not), then the residency (residency.py) decides
where each rank's experts live. One class per exchange, none per combination:

- `LocalExchange`: every expert on every rank. One process; or, under a multi-process launch
  with `parallel.ep_size` 1, data-parallel replicas (gradients averaged over the world, which
  is `StaticExchange` with ep_size 1).
- `StaticExchange` (`parallel.ep_size` > 1, or any multi-process launch): FastMoE's static
  expert parallelism, the experts split over the expert-parallel group, with MPipeMoE's
  pipelined all-to-all when `parallel.chunks` / `parallel.reuse` ask (`setup_expert_parallel`'s
  dispatchers). The dense gradients are averaged over the world: by DDP's bucketed all-reduce
  during backward (`training_module`, parallel/dense_ddp.py), or by FSDP2 when sharded.
- `DynamicExchange` (`parallel.placement dynamic`): ES-MoE's dynamic placement. Every iteration
  each layer places its experts by LPT on the node's ranks (`parallel.split`: hot experts' rows
  sharded). It only exchanges: where the experts live is the residency's (the node's ranks
  share one host copy in /dev/shm, computed in place or streamed through each rank's device:
  shared_store/residency.py).

Each exchange satisfies parts.py's `Exchange` Protocol.

An exchange's `step_metrics` adds the modelled per-rank load (and the pipelined layers'
choices) to each step's record. Checkpoints are run_state.py's (sharded).

Legend: E experts of a layer, W world size.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moescale.layers.moe import MoE
from moescale.parallel.choices import pipeline_choices
from moescale.parallel.dense_ddp import wrap_dense_ddp
from moescale.parallel.dense_shard import dense_mesh, require_fsdp2, shard_dense
from moescale.parallel.dynamic import (DynamicPlacementDispatcher, placement_stats,
                                       static_load_stats)
from moescale.parallel.expert_parallel import expert_parallel_model
from moescale.parallel.grad_sync import allreduce_gradients, expert_parameters
from moescale.parallel.groups import ParallelConfig, init_distributed
from moescale.parallel.nodes import node_layout
from moescale.parallel.placement import PlacementConfig
from moescale.parallel.setup import dispatcher_factory
from moescale.sizes import fmt_bytes
from moescale.train.config import RunConfig
from moescale.train.model import model_config
from moescale.train.ranks import check_rows, world_size_of_launch


def _launch_error(what: str) -> ValueError:
    return ValueError(f"parallel.placement='dynamic' {what}; launch with `torchrun "
                      "--nproc-per-node N -m moescale train --parallel.placement dynamic ...` "
                      "(or moescale.train.launch.train_distributed)")


def _pipelined_options(config: RunConfig) -> list[tuple[str, str, str]]:
    """(option, value, plain value) of each pipelined all-to-all option that is set."""
    pc = config.parallel
    return [(option, value, plain) for option, value, plain in
            (("parallel.chunks", pc.chunks, 1), ("parallel.reuse", pc.reuse, "none"))
            if value != plain]


def check_exchange(config: RunConfig) -> None:
    """The exchange's own refusals of options it cannot serve together (before any process
    or thread starts)."""
    pc, where = config.parallel, "parallel.placement='dynamic'"
    if pc.dense == "shard":
        require_fsdp2()
    if pc.placement == "static":
        if not pc.split:
            raise ValueError("parallel.split=false applies to parallel.placement dynamic "
                             "(hot-expert splitting); static placement never splits: drop it "
                             "or set parallel.placement dynamic")
        if pc.node_size:
            raise ValueError(f"parallel.node_size={pc.node_size} applies to parallel.placement "
                             "dynamic (a store per node); static placement has no nodes: drop "
                             "it or set parallel.placement dynamic")
        for option, value, plain in _pipelined_options(config):
            if pc.ep_size == 1:
                raise ValueError(f"{option}={value!r} needs expert parallelism (the pipelined "
                                 f"all-to-all); set parallel.ep_size > 1 or {option}={plain}")
        return
    if pc.ep_size != 1:
        raise ValueError(f"{where} with parallel.ep_size={pc.ep_size} conflicts: dynamic "
                         "placement spreads every expert over all local ranks each iteration "
                         "(ep_size is static placement's split); leave parallel.ep_size at 1")
    for option, value, plain in _pipelined_options(config):
        raise ValueError(f"{where} with {option}={value!r} is not supported: the pipelined "
                         f"all-to-all is static placement's; use {option} {plain}")
    if config.train.precision != "fp32":
        raise ValueError(f"{where} with train.precision={config.train.precision!r} is not "
                         "supported: the shared-store experts compute in fp32 on the host copy; "
                         "use train.precision fp32")
    if config.train.device.startswith("cuda"):
        raise ValueError(f"{where} with train.device={config.train.device!r} is not supported: "
                         "the experts compute on the shared host copy (CPU ranks, gloo); use "
                         "train.device cpu (or auto)")


def shard_dense_half(config: RunConfig, groups, model) -> str:
    """`parallel.dense shard`: the model's dense half sharded with FSDP2 over every rank
    (moescale/parallel/dense_shard.py), after the MoE layers got their dispatchers; the
    words for the run's summary ("" when replicated)."""
    if config.parallel.dense != "shard":
        return ""
    device_type = "cuda" if dist.get_backend(groups.world_group) == "nccl" else "cpu"
    shard_dense(model, dense_mesh(groups.world_size, groups.ep_size, device_type))
    return f"; dense half sharded over {groups.world_size} ranks (FSDP2)"


DDP_WORDS = "; dense half replicated, averaged by DDP during backward"


def replicated_ddp(config: RunConfig, groups, model):
    """`parallel.dense replicate` on several ranks: DDP around the model, its experts ignored
    (parallel/dense_ddp.py), which averages the dense gradients during backward; None when
    the dense half is sharded (FSDP2 reduces it), on one rank or without dense parameters
    that train. Collective: after the model is on its device."""
    if config.parallel.dense == "shard" or groups.world_size == 1:
        return None
    ignored = set(map(id, expert_parameters(model)))
    if not any(p.requires_grad for p in model.parameters() if id(p) not in ignored):
        return None
    return wrap_dense_ddp(model, groups)


def check_launch(config: RunConfig) -> None:
    """Refuse, before any process group exists, a launch the exchange cannot run on (dynamic
    placement: one process, a node size that does not divide the ranks, rows that do not
    split evenly)."""
    if config.parallel.placement != "dynamic":
        return
    world = world_size_of_launch()
    if world == 1 and "RANK" not in os.environ:
        raise _launch_error("needs the processes of a distributed launch")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    node_layout(world, rank, config.parallel.node_size, os.environ)
    check_rows(config.train.batch_size, world)


class LocalExchange:
    """Every expert on this process; no exchange (see the module docstring)."""

    groups = None

    def prepare(self, model) -> None:
        pass

    def training_module(self, model):
        return model

    def sync_grads(self, model) -> None:
        pass

    def begin_micro_batch(self, last: bool) -> None:
        pass

    def step_metrics(self, model, counts_LE) -> dict:
        return {}

    def describe(self) -> str:
        return ""

    def close(self) -> None:
        pass


class DenseSync:
    """A multi-rank exchange's gradient sync: the replicated dense half through DDP during
    backward (`replicated_ddp`), the rest after backward (`grad_sync.allreduce_gradients`:
    the experts over their dp column; the dense half too where it has no DDP)."""

    ddp = None

    def training_module(self, model):
        self.ddp = replicated_ddp(self.config, self.groups, model)
        if self.ddp is None:
            return model
        self.dense = DDP_WORDS
        return self.ddp

    def sync_grads(self, model) -> None:      # after it every backward has finished
        allreduce_gradients(model, self.groups, replicated=self.ddp is None)

    def ddp_micro_batch(self, last: bool) -> None:
        if self.ddp is not None:     # what DDP.no_sync() sets: reduce on the last one only
            self.ddp.require_backward_grad_sync = last


class StaticExchange(DenseSync):
    """Experts split over the ranks of an expert-parallel group (plain or pipelined)."""

    def __init__(self, config: RunConfig, ranks) -> None:
        pc = config.parallel
        experts = model_config(config, 2).moe.num_experts
        if experts % pc.ep_size:
            raise ValueError(f"parallel.ep_size={pc.ep_size} does not divide model.num_experts="
                             f"{experts}; choose num_experts as a multiple of ep_size")
        world = ranks.world_size
        if world < pc.ep_size or world % pc.ep_size:
            raise ValueError(f"parallel.ep_size={pc.ep_size} needs a multiple of {pc.ep_size} "
                             f"processes, but {world} {'is' if world == 1 else 'are'} running; "
                             f"launch with `torchrun --nproc-per-node {pc.ep_size} -m moescale "
                             "train ...` (or moescale.train.launch.train_distributed)")
        check_rows(config.train.batch_size, world)
        self.config = config
        self.pconfig = pc       # the run's [parallel] section is the library's ParallelConfig
        self.groups = init_distributed(self.pconfig)
        self.dense = ""

    def prepare(self, model) -> None:
        expert_parallel_model(model, self.groups, dispatcher_factory(self.groups, self.pconfig))
        self.dense = shard_dense_half(self.config, self.groups, model)

    def begin_micro_batch(self, last: bool) -> None:
        self.ddp_micro_batch(last)

    def step_metrics(self, model, counts_LE) -> dict:
        """Static placement's modelled per-rank load (rows) from the routed counts, and what
        each pipelined layer chose on its last call ({layer: [chunks, strategy]})."""
        out = {}
        choices = pipeline_choices(model)
        if choices:
            out["pipeline"] = {name: list(choice) for name, choice in choices.items()}
        if not counts_LE or self.groups.ep_size == 1:
            return out   # every rank holds every expert: no per-rank expert load
        stats = static_load_stats(counts_LE, self.groups.ep_size)
        return {**out, **{f"device_load_{k}": v for k, v in stats.items()}}

    def describe(self) -> str:
        g, pc = self.groups, self.pconfig
        limit = "" if pc.memory_limit_bytes is None else \
            f", memory limit {fmt_bytes(pc.memory_limit_bytes)} per layer step"
        return (f"experts split over {g.ep_size} expert-parallel ranks ({g.world_size} in all; "
                f"chunks {pc.chunks}, reuse {pc.reuse}{limit}{self.dense})")

    def close(self) -> None:
        pass


class DynamicExchange(DenseSync):
    """Each iteration LPT places a layer's experts on the node's ranks; nodes hold replicas
    (see the module docstring and docs/dynamic_placement.md)."""

    def __init__(self, config: RunConfig, ranks) -> None:
        check_launch(config)
        self.layout = node_layout(ranks.world_size, ranks.rank, config.parallel.node_size,
                                  os.environ)
        if dist.is_initialized() and dist.get_backend() != "gloo":
            raise ValueError(f"parallel.placement='dynamic' computes experts on the host copy "
                             f"and needs the gloo backend; the process group uses "
                             f"{dist.get_backend()}")
        if config.train.device == "auto":
            config.train.device = "cpu"    # the shared-store experts compute on the host
        self.config = config
        # ep_group: the node's L consecutive ranks; dp_group: the same local rank on every node
        self.groups = init_distributed(ParallelConfig(ep_size=self.layout.node_size,
                                                      backend="gloo",
                                                      timeout_s=config.parallel.timeout_s))
        self.ranks = ranks
        self._calls = []             # placement_stats of this step's micro-batches
        self._micro = 0
        self._model = None
        self.dense = ""

    def prepare(self, model) -> None:
        """Every MoE layer gets a DynamicPlacementDispatcher over the node's ranks (its
        balance-loss statistics summed over the world). The experts are the residency's."""
        placement = PlacementConfig(num_devices=self.layout.node_size,
                                    split=self.config.parallel.split)
        for moe in model.modules():
            if isinstance(moe, MoE):
                moe.dispatcher = DynamicPlacementDispatcher(
                    self.groups.ep_group, moe.num_experts, placement,
                    stats_group=dist.group.WORLD)
        self._model = model
        self.dense = shard_dense_half(self.config, self.groups, model)

    def begin_micro_batch(self, last: bool) -> None:
        self.ddp_micro_batch(last)
        self._collect(keep=self._micro > 0)   # the first one drops evaluation's calls
        self._micro += 1

    def _collect(self, keep: bool) -> None:
        stats = placement_stats(self._model)
        if keep and stats:
            self._calls.append(stats)
        for module in self._model.modules():
            if isinstance(module, MoE) and isinstance(module.dispatcher,
                                                      DynamicPlacementDispatcher):
                module.dispatcher.stats = None

    def step_metrics(self, model, counts) -> dict:
        self._collect(keep=True)
        calls, self._calls, self._micro = self._calls, [], 0
        max_load = sum(c["placement_max_load"] for c in calls)
        mean_load = sum(c["placement_mean_load"] for c in calls)
        worst = max((c["placement_max_over_mean"] for c in calls), default=1.0)
        split = sum(c["placement_split_experts"] for c in calls)
        if self.layout.num_nodes > 1:     # the busiest node's max, the mean over all devices
            dp = self.groups.dp_group
            max_load, worst = self.ranks.all_reduce(
                torch.tensor([max_load, worst], dtype=torch.float64), dist.ReduceOp.MAX, dp,
                "placement-statistics all-reduce").tolist()
            mean_load, split = self.ranks.all_reduce(
                torch.tensor([mean_load, split], dtype=torch.float64), dist.ReduceOp.SUM, dp,
                "placement-statistics all-reduce").tolist()
            mean_load /= self.layout.num_nodes
        out = {"device_load_max": max_load, "device_load_mean": mean_load,
               "device_load_max_over_mean": max_load / mean_load if mean_load > 0 else 1.0,
               "device_load_worst_layer": worst, "split_experts": int(split)}
        world = self.ranks.world_size
        if counts and all(len(c) % world == 0 for c in counts):
            static = static_load_stats(counts, world)
            out.update({f"static_load_{k}": v for k, v in static.items()})
        return out

    def describe(self) -> str:
        how = "LPT + hot-expert splitting" if self.config.parallel.split else "LPT"
        return f"placed each iteration by {how}{self.dense}"

    def close(self) -> None:
        pass


def make_exchange(config: RunConfig, ranks):
    """The exchange `config.parallel` asks for on these ranks."""
    if config.parallel.placement == "dynamic":
        return DynamicExchange(config, ranks)
    if config.parallel.ep_size > 1 or ranks.world_size > 1:
        return StaticExchange(config, ranks)
    return LocalExchange()
