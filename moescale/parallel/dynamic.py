"""Dynamic expert placement (ES-MoE): every iteration, each expert runs where LPT puts it.

Every rank of the group can compute every expert (all ranks share one host copy: the shared
ExpertStore, see `moescale/shared_store/experts.py`; replicated `GroupedExperts` also work). Per MoE call:

  counts   = all-gather of every rank's per-expert row counts -> counts_WE on every rank (host)
  plan     = plan_placement(sum over ranks, config): the same deterministic LPT on every rank,
             so nobody broadcasts a decision (a `placement_hook` may replace it, e.g. a random
             permutation in tests)
  layout   = pure host arithmetic on (counts_WE, placement) (moescale.dispatch.placed_layout):
             global rows of expert e are ordered (source rank, the source's row order); shard
             (e, d, a, b) takes global rows [a, b) of e to device d. Each rank knows every send
             and receive split, so no counts exchange is needed.
  dispatch = rows permuted into (destination, shard) order, uneven all-to-all
  experts  = received (source, shard) blocks reordered to (shard, source): the rows of each
             expert are contiguous, in ascending expert order -> experts.forward_rows, or
             forward_placed for a container declaring PLACED (moescale.dispatch.protocol)
  combine  = inverse reorder, all-to-all back, inverse permutation, score-weighted index_add

The row permutation follows the placement, whatever it is (tested under random placements:
ES-MoE's public code sends tokens to the wrong expert when placement departs from identity).

Gradient scale is the expert-parallel one (docs/expert_parallel.md): each rank back-propagates
its own loss, the model's loss is their mean; the dispatch all-to-all's backward multiplies by
W and the return's by 1/W, so expert gradients come out at the mean scale. A split expert's
rows run on several devices: its partial gradients must be summed (SharedStoreExperts does it
in backward; for replicated parameter experts call `sum_expert_grads`).

Load model: placing expert e on device d costs rows * row_cost (+ upload_cost when e is not
resident in d's cache: affinity); `load_model_config` builds it in seconds from an FFN
expert's FLOPs and measured device rates. After each call `dispatcher.stats` holds the
modelled per-device loads, max/mean and the number of split experts; `placement_stats(model)`
condenses them over a model's layers for the trainer to log.

Not here: the expert math and the optimizer step (shared_store/experts.py; streamed from a host
or disk store through each rank's device: shared_store/streamed.py), overlap of the exchanges with
compute. Placement is within a node (the group); across nodes the experts are
replicated per node (nodes.py).

Legend: T tokens, R rows this rank routed (grouped by expert), S rows received, D model width,
E experts, W ranks of the group (= devices of the node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from moescale.dispatch.index import inverse_permutation
from moescale.dispatch.local import combine_rows, gather_rows
from moescale.dispatch.placed_layout import RowLayout, row_layout
from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import PLACED, STREAMED, capabilities_of
from moescale.layers.experts import compute_dtype
from moescale.layers.moe import MoE
from moescale.parallel.all_to_all import all_reduce_sum, all_to_all_rows, collective_errors
from moescale.parallel.placement import Placement, PlacementConfig, plan_placement


def expert_row_flops(d_model: int, d_ff: int, glu: bool = False) -> float:
    """Forward FLOPs of one row through one FFN expert."""
    return 2.0 * d_model * d_ff * (3 if glu else 2)


def load_model_config(num_devices: int, d_model: int, d_ff: int, *, glu: bool = False,
                      flops_per_s: float, upload_bytes_per_s: float | None = None,
                      bytes_per_param: int = 2, split: bool = True,
                      max_experts_per_device: int | None = None) -> PlacementConfig:
    """The load model in seconds: a row costs forward + backward (3x forward) FLOPs of one
    expert at `flops_per_s`; an expert not resident in a device's cache costs its weights'
    upload at `upload_bytes_per_s` (None: no upload cost). Pass the devices' cached experts
    as `resident` to the dispatcher for affinity."""
    if not flops_per_s > 0 or (upload_bytes_per_s is not None and not upload_bytes_per_s > 0):
        raise ValueError(f"flops_per_s={flops_per_s!r} and upload_bytes_per_s="
                         f"{upload_bytes_per_s!r} must be > 0 (measured device rates)")
    params = d_model * d_ff * (3 if glu else 2)
    upload = 0.0 if upload_bytes_per_s is None else params * bytes_per_param / upload_bytes_per_s
    return PlacementConfig(num_devices=num_devices, split=split,
                           max_experts_per_device=max_experts_per_device,
                           row_cost=3 * expert_row_flops(d_model, d_ff, glu) / flops_per_s,
                           upload_cost=upload)


def placement_stats(model: torch.nn.Module) -> dict[str, float]:
    """Per-iteration numbers for the trainer's log, over the model's dynamic-placement
    layers: the worst layer's max/mean modelled device load, and the sums of the layers'
    max and mean loads (empty when no layer uses dynamic placement or none ran yet)."""
    stats = [m.dispatcher.stats for m in model.modules()
             if isinstance(m, MoE) and isinstance(m.dispatcher, DynamicPlacementDispatcher)
             and m.dispatcher.stats is not None]
    if not stats:
        return {}
    return {"placement_max_over_mean": max(s.imbalance for s in stats),
            "placement_max_load": sum(s.max_load for s in stats),
            "placement_mean_load": sum(s.mean_load for s in stats),
            "placement_split_experts": float(sum(s.num_split for s in stats))}


def static_load_stats(counts_LE: list[list[int]], num_devices: int) -> dict[str, float]:
    """The same numbers for static placement (expert e on device e // (E / W), expert
    parallelism's split) from per-layer routed rows: the sums over layers of the busiest
    device's rows and of the mean rows per device, and their ratio (1.0: balanced)."""
    max_sum = mean_sum = 0.0
    for counts_E in counts_LE:
        per = len(counts_E) // num_devices
        assert per * num_devices == len(counts_E), (len(counts_E), num_devices)
        loads = [sum(counts_E[d * per:(d + 1) * per]) for d in range(num_devices)]
        max_sum += max(loads)
        mean_sum += sum(loads) / num_devices
    return {"max": max_sum, "mean": mean_sum,
            "max_over_mean": max_sum / mean_sum if mean_sum > 0 else 1.0}


@dataclass
class PlacementStats:
    """The modelled loads of the last call (plain numbers, for logging)."""

    device_load: list[float]
    device_rows: list[int]
    max_load: float
    mean_load: float
    imbalance: float        # max / mean modelled load (1.0: perfect)
    num_split: int          # experts whose rows were sharded over several devices
    bound: float            # lower bound of max/mean without splitting: max(e load) * W / total


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


class DynamicPlacementDispatcher:
    """Per call: all-gather counts, plan LPT (+ split), move rows to this iteration's owners.

    group:     the ranks (devices) of the node that share one host copy of the experts.
    config:    PlacementConfig; num_devices must equal the group size.
    resident:  optional callable () -> per-device sets of experts already cached there
               (affinity); must return the same on every rank.
    placement_hook: optional (placement, counts_E) -> Placement, run after planning on every
               rank (it must be deterministic across ranks; tests use a seeded permutation).
    stats_group: the group the balance-loss statistics are summed over (default: `group`);
               across nodes the world (parallel/nodes.py), so the balance loss is the one of
               every token, as on one process.
    """

    def __init__(self, group, num_experts: int, config: PlacementConfig,
                 resident: Callable[[], list[set[int]]] | None = None,
                 placement_hook: Callable[[Placement, list[int]], Placement] | None = None,
                 stats_group=None) -> None:
        size = dist.get_world_size(group)
        if config.num_devices != size:
            raise ValueError(f"PlacementConfig(num_devices={config.num_devices}) must equal the "
                             f"group size {size}: every rank of the group is one device")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
        self.group, self.num_experts, self.config = group, num_experts, config
        self.rank, self.size = dist.get_rank(group), size
        self.resident, self.placement_hook = resident, placement_hook
        self.stats_group = group if stats_group is None else stats_group
        self.stats: PlacementStats | None = None
        self.last_placement: Placement | None = None
        self.last_layout: RowLayout | None = None

    def gather_counts(self, counts: list[int], device) -> list[list[int]]:
        """counts_WE on the host: one all-gather of E integers per rank, one sync."""
        local = torch.tensor(counts, dtype=torch.int64, device=device)
        out = torch.empty(self.size * self.num_experts, dtype=torch.int64, device=device)
        with collective_errors("counts all-gather", self.group):
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, local, group=self.group)
        flat = out.tolist()
        E = self.num_experts
        return [flat[s * E:(s + 1) * E] for s in range(self.size)]

    def place(self, counts_WE: list[list[int]]) -> Placement:
        total_E = [sum(col) for col in zip(*counts_WE)]
        resident = self.resident() if self.resident is not None else None
        placement = plan_placement(total_E, self.config, resident)
        if self.placement_hook is not None:
            placement = self.placement_hook(placement, total_E)
        self._record(placement, total_E)
        return placement

    def _record(self, placement: Placement, total_E: list[int]) -> None:
        rows = [0] * self.size
        loads = [0.0] * self.size
        for e, d, a, b in placement.raw_shards:
            rows[d] += b - a
            loads[d] += (b - a) * self.config.row_cost
        # the hook may move shards: recompute the row part, keep the planner's upload part
        if self.placement_hook is None:
            loads = list(placement.device_load)
        mean = sum(loads) / self.size
        total = sum(total_E) * self.config.row_cost
        self.stats = PlacementStats(
            device_load=loads, device_rows=rows, max_load=max(loads), mean_load=mean,
            imbalance=max(loads) / mean if mean > 0 else 1.0,
            num_split=len({e for e, d, a, b in placement.raw_shards if b - a < total_E[e]}),
            bound=max(1.0, max(total_E) * self.config.row_cost * self.size / total)
            if total else 1.0)
        self.last_placement = placement

    def __call__(self, x_TD: torch.Tensor, plan: RoutingPlan, experts) -> torch.Tensor:
        if len(plan.counts) != self.num_experts:
            raise ValueError(f"the routing plan has {len(plan.counts)} experts but the "
                             f"dispatcher was built for num_experts={self.num_experts}")
        caps = capabilities_of(experts)
        held = len(experts.expert_ids)
        if held != self.num_experts:
            raise ValueError(f"dynamic placement needs every expert on every rank (a shared "
                             f"store or replicated experts); the layer's experts hold {held} "
                             f"of {self.num_experts}")
        if STREAMED in caps and PLACED not in caps:
            raise ValueError(f"dynamic placement over {type(experts).__name__} (experts "
                             "streamed from a per-process store) is not supported: every "
                             "device computes partial gradients of the experts placed on it, "
                             "and per-process stores cannot sum them; use the node's shared "
                             "store (dynamic_placement_moe, streamed through each device by "
                             "shared_store.streamed.StreamedSharedExperts on the host or disk tier) "
                             "or replicated GroupedExperts")
        counts_WE = self.gather_counts(plan.counts, x_TD.device)
        placement = self.place(counts_WE)
        lay = row_layout(counts_WE, placement.raw_shards, self.rank, x_TD.device)
        self.last_layout = lay
        W, group = self.size, self.group
        x_TD = x_TD.to(compute_dtype(x_TD))
        x_sent = _take(gather_rows(x_TD, plan), lay.send_perm_R)
        x_SD = all_to_all_rows(x_sent, lay.send_splits, lay.recv_splits, group,
                               grad_scale=float(W))
        x_local = _take(x_SD, lay.expert_perm_S)
        if PLACED in caps:
            y_local = experts.forward_placed(x_local, lay.local_counts_E, lay.owners_E,
                                             lay.split_experts, group)
        else:
            y_local = experts.forward_rows(x_local, lay.local_counts_E)
        inv_local = None if lay.expert_perm_S is None else inverse_permutation(lay.expert_perm_S)
        y_SD = _take(y_local, inv_local)
        y_back = all_to_all_rows(y_SD, lay.recv_splits, lay.send_splits, group,
                                 grad_scale=1.0 / W)
        inv_send = None if lay.send_perm_R is None else inverse_permutation(lay.send_perm_R)
        return combine_rows(_take(y_back, inv_send), plan)

    def reduce_sum(self, stats: torch.Tensor) -> torch.Tensor:
        """Balance-loss statistics summed over `stats_group` (differentiable)."""
        return all_reduce_sum(stats, self.stats_group)


def sum_expert_grads(experts: torch.nn.Module, group) -> None:
    """Replicated parameter experts under dynamic placement: sum the partial gradients of
    every expert parameter over the group (each rank computed only the rows placed on it)."""
    for p in experts.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        with collective_errors("expert gradient all-reduce", group):
            dist.all_reduce(p.grad, group=group)


def random_placement_hook(seed: int, num_devices: int):
    """A placement_hook for tests: every call re-deals each shard to a random device (and may
    split an expert's rows at a random point), with a seeded generator identical on all ranks."""
    import random

    rng = random.Random(seed)

    def hook(placement: Placement, counts_E: list[int]) -> Placement:
        shards = []
        for e, n in enumerate(counts_E):
            if n == 0:
                continue
            cut = rng.randrange(0, n + 1) if n > 1 and rng.random() < 0.5 else n
            for a, b in ((0, cut), (cut, n)):
                if b > a:
                    shards.append((e, rng.randrange(num_devices), a, b))
        rng.shuffle(shards)
        return Placement(raw_shards=shards, device_load=[0.0] * num_devices)

    return hook
