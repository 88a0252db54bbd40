"""Experts of a node's shared host store, computed wherever dynamic placement puts them.

All local ranks attach to one `ExpertStore` in shared memory (tier 'host', shared_memory=True:
`shared_expert_store` in the launching process, `ExpertStore.attach` in the ranks), so any rank
can compute any expert and placement may change every iteration without moving weights.

`SharedStoreExperts` is the expert container of one layer (no parameters). Called by the
`DynamicPlacementDispatcher` as `forward_placed(x_RD, counts_E, owners_E, split_experts, group)`
(`forward_rows`, the Protocol's base path, is the same with every expert owned here):
- forward: the grouped FFN kernel on a copy of the fp32 masters of the experts that have rows
  on this device (A of the E: gradient buffers and weight reads scale with A, not E);
- backward: per-expert weight gradients of the rows computed here. An expert placed whole on
  this device is owned here: its gradient is added straight into the store's accumulator. A
  split expert's partial gradients are summed over the group with one all-reduce of the split
  experts' gradients (all ranks, same list), and its owner (the device of its first rows) adds
  the sum. Exactly one rank writes each accumulator per pass, and the passes of successive
  micro-batches are ordered by the collectives between them, so no two processes race.
- `step_shared_experts(layers, group, ...)`: after backward, a barrier (nobody reads a master
  after this until the fence), each rank steps with torch's AdamW the experts it owned in
  the last pass (experts without rows: owner e % W), zeroes their accumulators, then a second
  barrier: the cross-process fence. Every expert steps every iteration, as the offload
  engine's HostOptimizer and torch.optim.AdamW on a stacked parameter do.

Deliberately not done here (see docs/dynamic_placement.md): device copies through the offload
DeviceCache (streamed.py streams the store's experts through each rank's device; here
weights are read in place from host memory, which is what a CPU rank computes on), the eager
per-expert step overlapped with backward and per-expert cross-process fences (the barrier is a
coarse fence; the disk tier's fence is node_disk.py's, passed to `step_shared_experts`).

Legend: R rows on this device grouped by expert, D model width, F hidden width, E experts,
P parameters of one expert, S split experts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw

from moescale.dispatch.protocol import PLACED, STATE_ACCESS, STREAMED
from moescale.layers.activations import Activation
from moescale.layers.experts import GroupedExperts, compute_dtype
from moescale.layers.grouped_ffn import PARAM_NAMES, FFNWeights, ffn_backward, ffn_forward
from moescale.layers.moe import MoE
from moescale.offload.records import STATE
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig
from moescale.offload.store_access import StoreAccess
from moescale.parallel.all_to_all import collective_errors
from moescale.parallel.dynamic import DynamicPlacementDispatcher
from moescale.parallel.placement import PlacementConfig


def grouped_layout(experts: GroupedExperts) -> ExpertLayout:
    """The store layout of one GroupedExperts expert (the offload engine's order)."""
    return ExpertLayout([(n, tuple(getattr(experts, n).shape[1:])) for n in PARAM_NAMES
                         if getattr(experts, n) is not None])


def grouped_experts_of(moe: MoE, who: str) -> GroupedExperts:
    """The layer's GroupedExperts, or a ValueError naming `who` needs them."""
    if not isinstance(moe.experts, GroupedExperts):
        raise ValueError(f"{who} needs GroupedExperts; this layer has "
                         f"{type(moe.experts).__name__}")
    return moe.experts


def expert_master(experts: GroupedExperts, e: int) -> torch.Tensor:
    """Expert e's tensors flattened in the store's order (fp32 [P], a copy)."""
    return torch.cat([getattr(experts, n).detach()[e].reshape(-1).float() for n in PARAM_NAMES
                      if getattr(experts, n) is not None])


def shared_expert_store(moes: Sequence[MoE]) -> ExpertStore:
    """A host store in shared memory holding the experts of `moes` (layer i = moes[i]),
    initialised from their GroupedExperts. Hand `store.shared_state()` and `store.layouts`
    to the local ranks, which call `ExpertStore.attach`."""
    store = ExpertStore(StoreConfig(tier="host", shared_memory=True))
    for moe in moes:
        experts = grouped_experts_of(moe, "shared_expert_store")
        store.add_layer(grouped_layout(experts), experts.num_experts,
                        lambda e, experts=experts: expert_master(experts, e))
    return store


class _SharedStoreFn(torch.autograd.Function):
    """The grouped FFN on the experts that have rows here (A of the E), gradients into the
    store. Only the active experts are gathered (one copy of their masters per pass) and get
    gradient buffers: a device placed 8 of 64 experts pays for 8, not 64."""

    @staticmethod
    def forward(ctx, anchor, x_RD, layer: "SharedStoreExperts", counts: tuple,
                owners: tuple, split: tuple, group):
        active = tuple(e for e, n in enumerate(counts) if n)
        experts_A = torch.tensor(active, dtype=torch.int64)
        counts_A = tuple(counts[e] for e in active)
        y_RD, h1_RF, h3_RF = ffn_forward(x_RD, counts_A, layer.weights().take(experts_A),
                                         layer.act)
        ctx.layer, ctx.counts_A, ctx.group = layer, counts_A, group
        ctx.active, ctx.owners, ctx.split = active, owners, split
        ctx.save_for_backward(x_RD, h1_RF, h3_RF, experts_A)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        x_RD, h1_RF, h3_RF, experts_A = ctx.saved_tensors
        layer, active = ctx.layer, ctx.active
        dx_RD, gw, _ = ffn_backward(gy_RD.contiguous(), x_RD, h1_RF, h3_RF, ctx.counts_A,
                                    layer.weights().take(experts_A), layer.act,
                                    need_dx=ctx.needs_input_grad[1])
        grads = [getattr(gw, n) for n in PARAM_NAMES if getattr(gw, n) is not None]
        g_AP = torch.cat([g.reshape(len(active), -1).float() for g in grads], dim=1) \
            if active else torch.zeros(0, layer.layout.numel)
        rank = None if ctx.owners is None else dist.get_rank(ctx.group)   # None: forward_rows
        acc_EP = layer.grad_rows()
        split = set(ctx.split)
        whole = [i for i, e in enumerate(active) if e not in split]
        for i in whole:
            assert rank is None or ctx.owners[active[i]] == rank, (active[i], rank)
        if whole:
            pick = torch.tensor(whole, dtype=torch.int64)
            acc_EP.index_add_(0, experts_A.index_select(0, pick), g_AP.index_select(0, pick))
        if ctx.split:
            slot = {e: i for i, e in enumerate(active)}
            buf_SP = torch.zeros(len(ctx.split), layer.layout.numel, dtype=torch.float32)
            for i, e in enumerate(ctx.split):
                if e in slot:
                    buf_SP[i] = g_AP[slot[e]]
            with collective_errors("split-expert gradient all-reduce", ctx.group):
                dist.all_reduce(buf_SP, group=ctx.group)
            for i, e in enumerate(ctx.split):
                if ctx.owners[e] == rank:
                    acc_EP[e].add_(buf_SP[i])
        return None, dx_RD, None, None, None, None, None


class SharedStoreExperts(nn.Module):
    """All E FFN experts of one layer, read from (and accumulating into) a shared store.

    Declares PLACED (the dynamic dispatcher calls forward_placed with the placement's owners)
    and STREAMED (no parameters: gradients go to the store)."""

    capabilities = frozenset({PLACED, STREAMED, STATE_ACCESS})

    def __init__(self, store: ExpertStore, layer_index: int, d_model: int, d_ff: int,
                 activation, glu: bool, bias: bool) -> None:
        super().__init__()
        self.store, self.layer_index = store, layer_index
        self.layout = store.layouts[layer_index]
        self.num_experts = store.num_experts[layer_index]
        self.d_model, self.d_ff, self.glu, self.bias = d_model, d_ff, glu, bias
        self.act = activation if isinstance(activation, Activation) else Activation(activation)
        self.anchor = torch.empty(0, requires_grad=True)
        self.owners_E: list[int] | None = None   # owners of the last pass (who steps)
        data_E4P, _ = store.shared_state()[layer_index]
        self._data_E4P = data_E4P

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def state_access(self, key: str, optimizer=None, engine=None) -> StoreAccess:
        """STATE_ACCESS: this layer of the node's store (every expert; `share` splits the writing)."""
        return StoreAccess(key, self.store, self.layer_index)

    def weights(self) -> FFNWeights:
        """Stacked zero-copy views of the fp32 masters ([E, ...] each)."""
        master_EP = self._data_E4P[:, 0]
        parts, off = {}, 0
        for name, shape, size in zip(self.layout.names, self.layout.shapes, self.layout.sizes):
            parts[name] = master_EP[:, off:off + size].view(self.num_experts, *shape)
            off += size
        return FFNWeights(*(parts.get(n) for n in PARAM_NAMES))

    def records(self) -> torch.Tensor:
        """The layer's store records [E, 4, P] (masters, gradients, AdamW moments; a view)."""
        return self._data_E4P

    def grad_rows(self) -> torch.Tensor:
        """The store's gradient accumulators [E, P] (a view)."""
        return self._data_E4P[:, 1]

    def forward_placed(self, x_RD: torch.Tensor, counts: Sequence[int], owners_E: list[int],
                       split_experts: list[int], group) -> torch.Tensor:
        self.owners_E = list(owners_E)
        return self._run(x_RD, counts, tuple(owners_E), tuple(split_experts), group)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """The Protocol's base path: the placed path with every expert owned by this process
        and none split (its gradients go straight into the store's accumulators; with several
        processes on one store only one may call it per pass)."""
        self.owners_E = None
        return self._run(x_RD, counts, None, (), None)

    def _run(self, x_RD, counts, owners, split, group) -> torch.Tensor:
        if x_RD.device.type != "cpu":
            raise ValueError(f"SharedStoreExperts computes on the host copy in place; the rows "
                             f"arrive on {x_RD.device}. Device copies through the offload "
                             "DeviceCache are not done yet: run the dynamic layer on CPU ranks "
                             "(gloo), or use replicated GroupedExperts with sum_expert_grads")
        if compute_dtype(x_RD) != torch.float32:
            raise ValueError("SharedStoreExperts computes in fp32 on the host copy; run the "
                             "MoE layer without autocast (bf16 device copies are not done yet)")
        anchor = self.anchor if torch.is_grad_enabled() else self.anchor.detach()
        return _SharedStoreFn.apply(anchor, x_RD.float().contiguous(), self, tuple(counts),
                                    owners, split, group)

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e by plain ops, no gradient (for checks)."""
        with torch.no_grad():
            y, _, _ = ffn_forward(x_ND.float().contiguous(), (x_ND.shape[0],),
                                  self.weights().take(torch.tensor([e])), self.act)
        return y

    def master_state(self, e: int) -> dict[str, torch.Tensor]:
        """Copies of expert e's fp32 master tensors."""
        return {n: t.clone() for n, t in self.layout.split(self._data_E4P[e, 0]).items()}

    def extra_repr(self) -> str:
        return (f"layer={self.layer_index}, num_experts={self.num_experts}, "
                f"d_model={self.d_model}, d_ff={self.d_ff}, shared host store")


def dynamic_placement_moe(full: MoE, store: ExpertStore, layer_index: int, group,
                          config: PlacementConfig | None = None, **dispatcher_options) -> MoE:
    """A copy of `full` (same router weights) whose experts are layer `layer_index` of the
    shared `store`, dispatched by a DynamicPlacementDispatcher over `group`."""
    experts = grouped_experts_of(full, "dynamic placement")
    config = config or PlacementConfig(num_devices=dist.get_world_size(group))
    dispatcher = DynamicPlacementDispatcher(group, full.num_experts, config,
                                            **dispatcher_options)
    shared = SharedStoreExperts(store, layer_index, experts.d_model, experts.d_ff,
                                experts.act, experts.glu, experts.b1_EF is not None)
    weight = full.router.weight
    moe = MoE(config=full.config, experts=shared, dispatcher=dispatcher,
              device=weight.device, dtype=weight.dtype)
    moe.router.load_state_dict(full.router.state_dict())
    moe.train(full.training)
    return moe


def owned_experts(layer: SharedStoreExperts, rank: int, size: int) -> list[int]:
    """The experts `rank` steps after the last pass: those it owned (the device of their
    first rows), and e % size for experts that had no rows."""
    owners = layer.owners_E or [-1] * layer.num_experts
    return [e for e in range(layer.num_experts)
            if (owners[e] if owners[e] >= 0 else e % size) == rank]


def step_shared_experts(layers: Sequence[SharedStoreExperts], group, *, lr: float,
                        betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                        grad_coef: float | None = None, skip: bool = False,
                        fence: Callable[[], None] | None = None) -> int:
    """Barrier, AdamW step of the experts this rank owns (every expert of every layer is
    stepped by exactly one rank), zeroed accumulators, barrier. Returns how many this rank
    stepped. Call it on every rank after the iteration's last backward. skip=True: the same
    with no step (the accumulators are only zeroed; a training loop's guard skipped it).
    `fence` replaces the closing barrier (the disk tier's fence also writes back and agrees on
    the files, node_disk.py); a disk-tier store is stepped one expert at a time (its host
    cache need not hold every owned record at once; the fused AdamW math is per element, so
    the bits do not change)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    with collective_errors("barrier before the expert steps", group):
        dist.barrier(group=group)
    stepped = 0
    for layer in layers:
        mine = owned_experts(layer, rank, size)
        per = 1 if layer.store.config.tier == "disk" else max(1, len(mine))
        for i in range(0, len(mine), per):
            keys = [(layer.layer_index, e) for e in mine[i:i + per]]
            recs = [layer.store.acquire(key) for key in keys]
            try:
                if grad_coef is not None:
                    for r in recs:
                        r.grad_P.mul_(grad_coef)
                if not skip:
                    adamw([r.master_P for r in recs], [r.grad_P for r in recs],
                          [r.exp_avg_P for r in recs], [r.exp_avg_sq_P for r in recs], [],
                          [r.step_t for r in recs], fused=True, amsgrad=False,
                          beta1=betas[0], beta2=betas[1], lr=float(lr),
                          weight_decay=weight_decay, eps=eps, maximize=False)
                    stepped += len(recs)
                for r in recs:
                    r.grad_P.zero_()
            finally:
                for key in keys:
                    layer.store.release(key, dirty=True, rows=STATE, grad_zero=True)
                    if not skip:
                        layer.store.bump_version(key)
    if fence is not None:
        fence()
        return stepped
    with collective_errors("expert step fence (barrier)", group):
        dist.barrier(group=group)
    return stepped
