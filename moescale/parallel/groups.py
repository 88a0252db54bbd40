"""Process groups for expert parallelism: from torchrun's environment or given explicitly.

The world of W ranks is cut into expert-parallel (EP) groups of `ep_size` consecutive ranks
({0..P-1}, {P..2P-1}, ...): the experts of a layer are split over one EP group, and tokens move
inside it with all-to-all. The data-parallel (DP) group of a rank holds the ranks with the same
position in every EP group ({j, j+P, j+2P, ...}): they hold the same expert shard, so expert
gradients are averaged over it. Replicated parameters (router, attention, embeddings) are
averaged over the whole world (`ParallelGroups.world_group`).

Every EP group gets a second, identical process group (`ep_combine_group`) so that the pipelined
all-to-all can run its combine exchanges concurrently with the dispatch exchanges (collectives
on one group are serialized). Backend "auto" is NCCL when CUDA is available, gloo otherwise:
one code path for both.

This file only creates and describes groups; it never moves tensors. It does not pick devices
beyond setting the local CUDA device for NCCL, and it does not launch processes (see
`moescale.parallel.launch`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moescale.parallel.cost_model import STRATEGY_NAMES
from moescale.sizes import Size

BACKENDS = ("auto", "gloo", "nccl")
REUSE_CHOICES = (*STRATEGY_NAMES, "auto")
PLACEMENTS = ("static", "dynamic")
DENSE_MODES = ("replicate", "shard")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is split, and how experts and their tokens are exchanged (FastMoE,
    MPipeMoE, ES-MoE's placement). The trainer's run config nests it as `[parallel]`; a
    field's trailing comment is its documentation (--help shows it).

    memory_limit_bytes bounds the automatic choices (forward + backward of one layer, weight
    gradients included; see moescale.parallel.memory_model): reuse="auto" picks among the
    strategies that fit, chunks="auto" tries only chunk counts at which one fits (more chunks
    when needed); a fixed chunk count at which nothing fits raises, naming the fewest that would.
    """

    ep_size: int | None = None      # ranks the experts of each layer are split over (None: the
                                    # whole world)
    backend: str = "auto"           # auto (nccl with CUDA, else gloo) | gloo | nccl
    timeout_s: float = 300.0        # a collective waiting longer fails instead of hanging
    chunks: int | str = 1           # pipelined all-to-all: 1 (plain exchange), a chunk count, or
                                    # auto (tuned online)
    reuse: str = "none"             # pipelined memory reuse: none | S1..S4 | auto (cost model)
    memory_limit_bytes: Size | None = None   # pipelined, per rank: peak bytes one MoE layer step
                                             # may reach (unset: no limit)
    placement: str = "static"       # static (expert e on rank e // (E / ep_size)) | dynamic
                                    # (the ranks of a node share one expert copy; LPT placement
                                    # by token load every iteration)
    split: bool = True              # dynamic: shard the rows of experts heavier than a device's
                                    # share over several devices
    node_size: int = 0              # dynamic: ranks per node (each node its own expert copy,
                                    # gradients averaged across nodes); 0: the ranks of a machine
    dense: str = "replicate"        # the dense half (attention, embeddings, routers, norms):
                                    # replicate (every rank a full copy, gradients all-reduced)
                                    # | shard (FSDP2 over every rank that replicates it; one
                                    # process: nothing to shard). docs/scale_out.md

    def __post_init__(self) -> None:
        if self.chunks != "auto" and (not isinstance(self.chunks, int) or
                                      isinstance(self.chunks, bool) or self.chunks < 1):
            raise ValueError(f"chunks={self.chunks!r} must be a positive integer or 'auto'")
        if self.reuse not in REUSE_CHOICES:
            raise ValueError(f"reuse={self.reuse!r} is unknown; use one of "
                             f"{', '.join(REUSE_CHOICES)}")
        if self.ep_size is not None and (not isinstance(self.ep_size, int) or self.ep_size < 1):
            raise ValueError(f"ep_size={self.ep_size!r} must be a positive integer (the number "
                             "of ranks the experts are split over), or None for the world size")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of "
                             f"{', '.join(BACKENDS)}")
        if self.memory_limit_bytes is not None and not self.memory_limit_bytes > 0:
            raise ValueError(f"memory_limit_bytes={self.memory_limit_bytes!r} must be > 0 "
                             "(per-rank peak bytes of one layer step), or None for no limit")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be > 0 seconds (collectives "
                             "that wait longer fail instead of hanging)")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is unknown; use one of "
                             f"{', '.join(PLACEMENTS)}")
        if self.dense not in DENSE_MODES:
            raise ValueError(f"dense={self.dense!r} is unknown; use one of "
                             f"{', '.join(DENSE_MODES)} (how the dense half is held per rank)")
        if not isinstance(self.node_size, int) or self.node_size < 0:
            raise ValueError(f"node_size={self.node_size!r} must be >= 0 (0: the ranks of each "
                             "machine; N: nodes of N consecutive ranks)")

    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


@dataclass
class ParallelGroups:
    """This rank's groups. `ep_group`/`dp_group` None means the default (world) group."""

    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    ep_combine_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    world_group: dist.ProcessGroup | None = None
    timeout_s: float = 300.0

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in EP-rank order."""
        if self.ep_group is None:
            return list(range(self.world_size))
        return dist.get_process_group_ranks(self.ep_group)


def split_ranks(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep_groups, dp_groups) as lists of global ranks; validates divisibility."""
    if ep_size > world_size or world_size % ep_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"ep_size={ep_size} must divide the world size {world_size}; use an "
                         f"ep_size among {divisors}")
    num_ep = world_size // ep_size
    ep_groups = [list(range(g * ep_size, (g + 1) * ep_size)) for g in range(num_ep)]
    dp_groups = [list(range(j, world_size, ep_size)) for j in range(ep_size)]
    return ep_groups, dp_groups


def init_default_group(config: ParallelConfig,
                       launch_hint: str = "`torchrun --nproc-per-node N ...`, or call "
                                          "torch.distributed.init_process_group yourself "
                                          "first") -> None:
    """Initialize torch.distributed's default group from torchrun's environment, once.

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for NCCL); a missing one
    is a ValueError that tells how to launch (`launch_hint`). An existing group is kept."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ValueError(f"environment variables {', '.join(missing)} are not set; launch "
                         f"with {launch_hint}")
    backend = config.resolved_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=config.timeout)


def init_distributed(config: ParallelConfig | None = None) -> ParallelGroups:
    """Initialize torch.distributed from torchrun's environment (once: init_default_group) and
    build the groups. If the default group already exists only the groups are built.
    """
    config = config or ParallelConfig()
    init_default_group(config)
    return build_groups(config)


def build_groups(config: ParallelConfig | None = None) -> ParallelGroups:
    """Create the EP, EP-combine and DP groups on an initialized default group.

    Collective: every rank of the world must call it, with the same config.
    """
    config = config or ParallelConfig()
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized; call init_distributed() or "
                         "torch.distributed.init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    ep_size = world_size if config.ep_size is None else config.ep_size
    ep_groups, dp_groups = split_ranks(world_size, ep_size)
    kw = dict(timeout=config.timeout)
    mine = {}
    # every rank creates every group, in the same order (new_group is collective)
    for ranks in ep_groups:
        group = dist.new_group(ranks, **kw)
        combine = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["ep"], mine["combine"] = group, combine
    for ranks in dp_groups:
        group = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["dp"] = group
    return ParallelGroups(
        world_size=world_size, rank=rank, ep_size=ep_size, ep_rank=rank % ep_size,
        ep_group=mine["ep"], ep_combine_group=mine["combine"],
        dp_size=world_size // ep_size, dp_rank=rank // ep_size, dp_group=mine["dp"],
        world_group=None, timeout_s=config.timeout_s)


def groups_from(ep_group: dist.ProcessGroup | None = None, *,
                dp_group: dist.ProcessGroup | None = None,
                ep_combine_group: dist.ProcessGroup | None = None,
                world_group: dist.ProcessGroup | None = None,
                timeout_s: float = 300.0) -> ParallelGroups:
    """Describe groups the caller created. ep_group None: the world is one EP group.

    Without `ep_combine_group` the pipelined combine shares the dispatch group (correct,
    only less concurrent). Without `dp_group` expert shards are assumed not replicated.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first")
    ep_size = dist.get_world_size(ep_group)
    ep_rank = dist.get_rank(ep_group)
    if ep_rank < 0:
        raise ValueError("this rank is not a member of the given ep_group; every rank passes "
                         "the EP group it belongs to")
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    return ParallelGroups(
        world_size=dist.get_world_size(), rank=dist.get_rank(), ep_size=ep_size,
        ep_rank=ep_rank, ep_group=ep_group,
        ep_combine_group=ep_combine_group if ep_combine_group is not None else ep_group,
        dp_size=dp_size, dp_rank=dp_rank, dp_group=dp_group, world_group=world_group,
        timeout_s=timeout_s)
