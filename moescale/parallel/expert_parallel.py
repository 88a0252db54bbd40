"""Static expert parallelism: E experts split over the W ranks of an expert-parallel group.

Rank r holds experts [r*L, (r+1)*L), L = E/W, as an `ExpertShard` (moescale.layers.shard; any
expert container with L experts: stacked, module, offloaded; re-exported here); the router is
replicated. The `ExpertParallelDispatcher` plugs into the MoE seam (`dispatcher(x_TD, plan,
experts)`) and calls the shard's `forward_rows` (moescale.dispatch.protocol), so the layer's
math is unchanged and any residency works behind it:

  plan rows grouped by global expert = grouped by (owner rank p, local expert l)
  send splits  = per-owner sums of plan.counts            (host ints, no sync)
  counts       = one small all-to-all of the [W, L] row counts; one host sync
  dispatch     = all-to-all of the rows; they arrive grouped (source s, local expert l)
  experts      = reorder to (l, s) with one index_select, forward_rows, reorder back
  combine      = all-to-all back, then score-weighted index_add on the source rank

Gradient scale: each rank back-propagates its own loss; the model's loss is their mean (so a
replicated gradient is averaged over ranks, as DDP does). Autograd alone would give an expert
the SUM of the W ranks' contributions (FastMoE's W-times-too-large expert gradient); the
return all-to-all's backward multiplies by 1/W on the way into the experts and the dispatch
all-to-all's backward by W on the way out, so expert weight gradients come out at the mean
scale while input gradients are untouched. See docs/expert_parallel.md.

Capacity (when the layer has a capacity factor) is computed by each rank on its own tokens:
expert e keeps at most `capacity` rows from each source rank.

Not here: the index math of the reorder (`moescale.dispatch.index`), chunked pipelining
(`moescale.parallel.pipeline`), dynamic placement, gradient synchronization
(`moescale.parallel.grad_sync`).

Legend: T tokens, R rows sent (grouped by global expert), S rows received, D model width,
E experts in total, W ranks of the EP group, L = E / W experts per rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moescale.dispatch.index import expert_major_order, inverse_permutation
from moescale.dispatch.local import combine_rows, gather_rows
from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import capabilities_of
from moescale.layers.experts import GroupedExperts, ModuleExperts, compute_dtype
from moescale.layers.moe import MoE, MoEConfig
from moescale.layers.shard import (EXPERT_ATTR, ExpertShard, is_expert_parameter,
                                   mark_expert_parameters)
from moescale.parallel.all_to_all import all_reduce_sum, all_to_all_rows, exchange_counts
from moescale.parallel.groups import ParallelGroups

__all__ = ["EXPERT_ATTR", "ExpertParallelDispatcher", "ExpertShard", "expert_parallel_model",
           "expert_parallel_moe", "expert_parallel_split", "is_expert_parameter",
           "mark_expert_parameters", "shard_experts", "shard_moe"]

def expert_parallel_split(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global expert ids held by `ep_rank`."""
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts!r} must be a positive multiple of the "
                         f"expert-parallel size {ep_size}; use num_experts = k * {ep_size}")
    local = num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


class ExpertParallelDispatcher:
    """Static EP: send rows to the experts' owners, run the local shard, send results back."""

    def __init__(self, groups: ParallelGroups, num_experts: int) -> None:
        self.groups = groups
        self.expert_ids = expert_parallel_split(num_experts, groups.ep_size, groups.ep_rank)
        self.num_experts = num_experts
        self.num_local = len(self.expert_ids)

    def route_counts(self, plan: RoutingPlan, device) -> tuple[list[list[int]],
                                                               list[list[int]]]:
        """(send_counts_WL, recv_counts_WL) as host lists: one small all-to-all, one sync."""
        if len(plan.counts) != self.num_experts:
            raise ValueError(f"the routing plan has {len(plan.counts)} experts but the "
                             f"dispatcher was built for num_experts={self.num_experts}")
        W, L = self.groups.ep_size, self.num_local
        send_WL = [list(plan.counts[p * L:(p + 1) * L]) for p in range(W)]
        recv_WL = exchange_counts(torch.tensor(send_WL, dtype=torch.int64, device=device),
                                  self.groups.ep_group).tolist()
        return send_WL, recv_WL

    def __call__(self, x_TD: torch.Tensor, plan: RoutingPlan, experts) -> torch.Tensor:
        capabilities_of(experts)
        held = len(experts.expert_ids)
        if held != self.num_local:
            raise ValueError(f"the layer's experts hold {held} experts on this rank but expert "
                             f"parallelism over {self.groups.ep_size} ranks puts "
                             f"{self.num_local} here; build the layer with shard_moe(), "
                             "expert_parallel_moe() or expert_parallel_model()")
        W, group = self.groups.ep_size, self.groups.ep_group
        send_WL, recv_WL = self.route_counts(plan, x_TD.device)
        send_splits = [sum(row) for row in send_WL]
        recv_splits = [sum(row) for row in recv_WL]
        x_TD = x_TD.to(compute_dtype(x_TD))   # send rows in the compute precision
        x_RD = gather_rows(x_TD, plan)
        x_SD = all_to_all_rows(x_RD, send_splits, recv_splits, group, grad_scale=float(W))
        perm_S, local_counts = expert_major_order(recv_WL, x_TD.device)
        x_local = x_SD if perm_S is None else x_SD.index_select(0, perm_S)
        y_local = experts.forward_rows(x_local, local_counts)
        y_SD = y_local if perm_S is None else y_local.index_select(0, inverse_permutation(perm_S))
        y_RD = all_to_all_rows(y_SD, recv_splits, send_splits, group, grad_scale=1.0 / W)
        return combine_rows(y_RD, plan)

    def reduce_sum(self, stats: torch.Tensor) -> torch.Tensor:
        """Balance-loss statistics summed over the EP group (differentiable)."""
        return all_reduce_sum(stats, self.groups.ep_group)


def shard_experts(experts: nn.Module, groups: ParallelGroups) -> ExpertShard:
    """This rank's slice of a full expert container (weights copied, not shared)."""
    ids = expert_parallel_split(experts.num_experts, groups.ep_size, groups.ep_rank)
    if isinstance(experts, GroupedExperts):
        local = GroupedExperts(len(ids), experts.d_model, experts.d_ff,
                               activation=experts.act.spec,
                               glu=experts.glu, bias=experts.b1_EF is not None,
                               device=experts.w1_EDF.device, dtype=experts.w1_EDF.dtype)
        with torch.no_grad():
            for name in ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED"):
                src = getattr(experts, name)
                if src is not None:
                    getattr(local, name).copy_(src[ids.start:ids.stop])
    elif isinstance(experts, ModuleExperts):
        local = ModuleExperts([copy.deepcopy(experts.experts[e]) for e in ids])
    else:
        raise ValueError(f"cannot shard experts of type {type(experts).__name__}; use "
                         "GroupedExperts or ModuleExperts")
    return ExpertShard(local, experts.num_experts, ids)


def shard_moe(full: MoE, groups: ParallelGroups, dispatcher=None) -> MoE:
    """An expert-parallel copy of a single-process MoE: same router weights (replicated), this
    rank's slice of the experts, `dispatcher` (default: an ExpertParallelDispatcher).
    `full` is left unchanged."""
    weight = full.router.weight
    if dispatcher is None:
        dispatcher = ExpertParallelDispatcher(groups, full.num_experts)
    moe = MoE(config=full.config, experts=shard_experts(full.experts, groups),
              dispatcher=dispatcher,
              device=weight.device, dtype=weight.dtype)
    moe.router.load_state_dict(full.router.state_dict())
    moe.train(full.training)
    return moe


def expert_parallel_moe(groups: ParallelGroups, d_model: int, num_experts: int,
                        top_k: int = 2, *, device=None, dtype=None, **options) -> MoE:
    """An MoE of `num_experts` experts in total, this rank holding its E/W of them.

    `options` are MoE's (d_ff, activation, glu, bias, router, capacity_factor, ...). The router
    is initialized from torch's RNG: seed every rank alike (or broadcast it) so it is replicated.
    """
    act = options.pop("activation", None)
    if isinstance(act, str):
        options["activation"] = act
    cfg = MoEConfig.from_flat(d_model=d_model, num_experts=num_experts, top_k=top_k, **options)
    ids = expert_parallel_split(num_experts, groups.ep_size, groups.ep_rank)
    local = GroupedExperts(len(ids), cfg.d_model, cfg.d_ff,
                           activation=act if act is not None else cfg.activation,
                           glu=cfg.glu, bias=cfg.bias, device=device, dtype=dtype)
    return MoE(config=cfg, experts=ExpertShard(local, num_experts, ids),
               dispatcher=ExpertParallelDispatcher(groups, num_experts), device=device,
               dtype=dtype)


def expert_parallel_model(model: nn.Module, groups: ParallelGroups,
                          dispatcher_factory=None) -> nn.Module:
    """Replace every MoE of `model` (in place) by its expert-parallel shard; returns `model`.

    Every rank must start from identical weights (same seed, or a loaded checkpoint): each
    keeps the router and its slice of the experts. `dispatcher_factory(moe) -> dispatcher`
    picks the dispatcher per layer (default: ExpertParallelDispatcher).
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, MoE) and not isinstance(child.experts, ExpertShard):
                dispatcher = dispatcher_factory(child) if dispatcher_factory else None
                setattr(module, name, shard_moe(child, groups, dispatcher))
    return model
