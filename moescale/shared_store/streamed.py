"""Dynamic placement over offloaded experts: a node's store streamed through each rank's device.

The node's ranks share one ExpertStore: the host tier in /dev/shm (`node_expert_store`) or the
disk tier in a directory of the node (`node_disk_store`, node_disk.py). Each iteration LPT
assigns experts (and shards of hot ones) to the ranks as before (parallel/dynamic.py); a rank
uploads only the experts it was assigned, one after another, through its own byte-budgeted device
(`make_device`) and `DeviceCache` (upload of expert i+1 overlapped with expert i's compute),
computes with the compute copy and drops it.

`StreamedSharedExperts` is the expert container of one layer (PLACED, STREAMED, FFN_SHAPE; no
parameters), called as `forward_placed(x_RD, counts_E, owners_E, split_experts, group)`
(`forward_rows`, the Protocol's base path, is the same with every expert owned here) and run by the offload package's one per-expert stream (offload/chunked.py: `StreamedChunkRunner`,
with `_PlacedPass` as its host) on the offloaded experts' grouped math (`GroupedExpertMath`):
- forward: the experts with rows here, in ascending id, each uploaded and run by the grouped
  FFN kernel on its rows; the hidden is kept (activation policy `keep`) or recomputed in
  backward (`recompute`);
- backward: the same experts in reverse, re-uploaded (the device budget holds the weights and
  one gradient); an expert placed whole here is owned here: its gradient is added to the
  store's fp32 accumulator (`acquire(G)` / `release(dirty)`: in place in /dev/shm, or through
  this rank's disk cache); a split expert's partial gradients are summed over the group by one
  all-reduce and its owner (the device of its first rows) adds the sum. One writer per
  accumulator per pass, as with `SharedStoreExperts`.
The step is the shared store's (`step_shared_experts`: each expert stepped by its owner between
barriers). On the disk tier every rank caches records in its own host slots, so the barriers
become fences that also write back, re-read and agree on the files (node_disk.py).

Not here: eager per-expert steps overlapped with backward (the step runs after backward),
pinning hot experts in the device cache (a pinned copy's staleness is per process), the
`offload` activation policy, bf16 compute, module experts, CUDA (dynamic placement runs on
gloo CPU ranks; the device is simulated with a byte budget).

Legend: R rows on this device grouped by expert, N rows of one expert, D model width, F hidden
width, E experts, P parameters of one expert, S split experts.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from moescale.devices import make_device
from moescale.dispatch.protocol import FFN_SHAPE, PLACED, STATE_ACCESS, STREAMED
from moescale.layers.activations import Activation
from moescale.layers.experts import compute_dtype
from moescale.layers.grouped_ffn import ffn_forward
from moescale.offload.cache import DeviceCache
from moescale.offload.chunked import StreamedChunkRunner
from moescale.offload.experts import GroupedExpertMath
from moescale.offload.records import G
from moescale.offload.store import ExpertStore
from moescale.offload.store_access import StoreAccess
from moescale.parallel.all_to_all import collective_errors
from moescale.shared_store.experts import SharedStoreExperts

POLICIES = ("keep", "recompute")


class _BarrierFenced:
    """The DeviceCache's step fences: none per expert. Experts step only between the
    barriers (or disk fences) of `step_shared_experts`, when no upload is in flight."""

    @staticmethod
    def wait_step(key) -> None:
        return None

    @staticmethod
    def step_fence(key):
        return None


class RankDevice:
    """One rank's device and its cache of compute copies over the node's store."""

    def __init__(self, store: ExpertStore, *, budget_bytes: int | None = None,
                 budget_experts: float | None = 3.0, lookahead: int = 1) -> None:
        largest = max(lay.numel for lay in store.layouts) * 4      # fp32 compute copies
        if budget_bytes is None:
            budget_bytes = int(budget_experts * largest)
        if budget_bytes < 2 * largest:
            raise ValueError(f"device budget of {budget_bytes} bytes holds fewer than two "
                             f"experts of {largest} bytes (backward holds an expert and its "
                             f"gradient); raise it to at least {2 * largest} bytes "
                             "(offload.device_budget_experts 2)")
        self.device = make_device("cpu", budget_bytes)
        self.cache = DeviceCache(self.device, store, _BarrierFenced(), torch.float32,
                                 lookahead=lookahead)

    def memory(self) -> dict:
        return {"device_peak_bytes": int(self.device.peak_bytes),
                "device_budget_bytes": self.device.budget_bytes}


class _PlacedPass:
    """One pass of a placed layer as the offload stream's host (offload/chunked.py,
    StreamHost): the experts with rows here in ascending id, backward in reverse; a whole
    expert's gradient into the store by its owner (here), a split one's into `buf_SP` for
    the group's all-reduce."""

    last_micro_batch = True     # the step is the shared store's, between barriers

    def __init__(self, layer: "StreamedSharedExperts", owners: tuple, split: tuple) -> None:
        self.layer, self.owners, self.split = layer, owners, split
        self.activation_policy = layer.policy
        self.slot = {e: i for i, e in enumerate(split)}
        self.buf_SP: torch.Tensor | None = None
        self.rank = -1

    def chunk_orders(self, layer: int, chunk_counts, traced: bool) -> list[list[int]]:
        return [[e for e, n in enumerate(counts) if n] for counts in chunk_counts]

    def chunk_backward_orders(self, layer: int, orders, last: bool, last_chunk):
        return [order[::-1] for order in orders]

    def walk(self, layer: int, order: list[int], grad_bytes: int = 0):
        return self.layer.rank_device.cache.walk(layer, order, headroom=grad_bytes)

    def reserve_gradient(self, key, nbytes: int):
        return self.layer.rank_device.device.reserve(nbytes, f"gradient of expert {key}",
                                                     block=True)

    def hand_gradient(self, key, grads, reservation, last: bool) -> None:
        try:
            g_P = torch.cat([g.reshape(-1).float() for g in grads])
        finally:
            reservation.release()
        e = key[1]
        if e in self.slot:
            self.buf_SP[self.slot[e]] = g_P
        else:
            assert self.rank is None or self.owners[e] == self.rank, (e, self.rank)
            self.layer.accumulate(e, g_P)


class _StreamedFn(torch.autograd.Function):
    """The experts with rows here, streamed one at a time; gradients into the store."""

    @staticmethod
    def forward(ctx, anchor, x_RD, layer: "StreamedSharedExperts", counts: tuple,
                owners: tuple, split: tuple, group):
        placed = _PlacedPass(layer, owners, split)
        runner = StreamedChunkRunner(layer, [counts], 1.0, traced=False, host=placed)
        y_RD = runner.forward(0, x_RD, keep=True)
        ctx.runner, ctx.placed, ctx.group = runner, placed, group
        ctx.save_for_backward(x_RD)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        (x_RD,) = ctx.saved_tensors
        runner, placed = ctx.runner, ctx.placed
        placed.rank = None if placed.owners is None else dist.get_rank(ctx.group)  # None:
        # forward_rows (every expert owned here)
        placed.buf_SP = torch.zeros(len(placed.split), runner.layer.layout.numel,
                                    dtype=torch.float32)
        dx_RD, _ = runner.backward(0, x_RD, gy_RD.contiguous(), None, ctx.needs_input_grad[1],
                                   False)
        if placed.split:
            with collective_errors("split-expert gradient all-reduce", ctx.group):
                dist.all_reduce(placed.buf_SP, group=ctx.group)
            for i, e in enumerate(placed.split):
                if placed.owners[e] == placed.rank:
                    runner.layer.accumulate(e, placed.buf_SP[i])
        runner.input_grads(())
        ctx.runner = ctx.placed = None
        return None, dx_RD, None, None, None, None, None


class StreamedSharedExperts(GroupedExpertMath, nn.Module):
    """All E FFN experts of one layer of the node's store, streamed through this rank's device
    (see the module docstring). Declares PLACED, STREAMED and FFN_SHAPE."""

    capabilities = frozenset({PLACED, STREAMED, FFN_SHAPE, STATE_ACCESS})

    def __init__(self, store: ExpertStore, layer_index: int, rank_device: RankDevice,
                 d_model: int, d_ff: int, activation, glu: bool, bias: bool,
                 policy: str = "keep") -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"activation policy {policy!r} is not supported with dynamic "
                             f"placement; use one of {', '.join(POLICIES)}")
        self.store, self.layer_index, self.rank_device = store, layer_index, rank_device
        self.layout = store.layouts[layer_index]
        self.num_experts = store.num_experts[layer_index]
        self.d_model, self.d_ff, self.glu, self.bias = d_model, d_ff, glu, bias
        self.act = activation if isinstance(activation, Activation) else Activation(activation)
        self.policy = policy
        self.anchor = torch.empty(0, requires_grad=True)
        self.owners_E: list[int] | None = None   # owners of the last pass (who steps)
        self.before_inference = None    # collective callable run before a pass without grad

    @classmethod
    def replacing(cls, shared: SharedStoreExperts, store: ExpertStore,
                  rank_device: RankDevice, policy: str = "keep") -> "StreamedSharedExperts":
        """The streamed container of the same layer (same shape), over `store`."""
        return cls(store, shared.layer_index, rank_device, shared.d_model, shared.d_ff,
                   shared.act, shared.glu, shared.bias, policy)

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def state_access(self, key: str, optimizer=None, engine=None) -> StoreAccess:
        """STATE_ACCESS: this layer of the node's host or disk store."""
        return StoreAccess(key, self.store, self.layer_index)

    @property
    def tier(self) -> str:
        return self.store.config.tier

    def accumulate(self, e: int, g_P: torch.Tensor) -> None:
        """Add a gradient to expert e's fp32 accumulator in the store (the owner only)."""
        key = (self.layer_index, e)
        rec = self.store.acquire(key, G)
        try:
            rec.grad_P.add_(g_P)
        finally:
            self.store.release(key, dirty=True, rows=G)

    def records(self) -> torch.Tensor:
        """The layer's records [E, 4, P]: the shared host tensor, or (disk tier) a meta tensor
        of that shape (nothing in memory; for sizes only)."""
        if self.tier == "host":
            return self.store.shared_state()[self.layer_index][0]
        return torch.empty(self.num_experts, 4, self.layout.numel, device="meta")

    def grad_rows(self) -> torch.Tensor:
        """The host tier's accumulators [E, P] (a view); the disk tier has none in memory."""
        if self.tier != "host":
            raise ValueError("the disk tier's gradient accumulators live in its files; read "
                             "them with store.acquire(key, G)")
        return self.records()[:, 1]

    def forward_placed(self, x_RD: torch.Tensor, counts: Sequence[int], owners_E: list[int],
                       split_experts: list[int], group) -> torch.Tensor:
        if x_RD.device.type != "cpu":
            raise ValueError(f"StreamedSharedExperts runs on gloo CPU ranks (a simulated "
                             f"device); the rows arrive on {x_RD.device}")
        if compute_dtype(x_RD) != torch.float32:
            raise ValueError("StreamedSharedExperts computes in fp32; run the MoE layer "
                             "without autocast (train.precision fp32)")
        if not torch.is_grad_enabled() and self.before_inference is not None:
            self.before_inference()     # e.g. the disk tier's views agreed after a load
        self.owners_E = list(owners_E)
        return self._run(x_RD, counts, tuple(owners_E), tuple(split_experts), group)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """The Protocol's base path: the placed path with every expert owned by this process
        and none split (gradients into the store's accumulators; one process per pass)."""
        self.owners_E = None
        return self._run(x_RD, counts, None, (), None)

    def _run(self, x_RD, counts, owners, split, group) -> torch.Tensor:
        anchor = self.anchor if torch.is_grad_enabled() else self.anchor.detach()
        return _StreamedFn.apply(anchor, x_RD.float().contiguous(), self, tuple(counts),
                                 owners, split, group)

    def master(self, e: int) -> torch.Tensor:
        """A copy of expert e's flat fp32 master."""
        key = (self.layer_index, e)
        master_P, done = self.store.read_master(key)
        try:
            return master_P.clone()
        finally:
            done()

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e from its fp32 master by plain ops, no gradient (for checks)."""
        with torch.no_grad():
            y, _, _ = ffn_forward(x_ND.float().contiguous(), (x_ND.shape[0],),
                                  self.weights(self.master(e)), self.act)
        return y

    def master_state(self, e: int) -> dict[str, torch.Tensor]:
        """Copies of expert e's fp32 master tensors."""
        return self.layout.split(self.master(e))

    def extra_repr(self) -> str:
        return (f"layer={self.layer_index}, num_experts={self.num_experts}, d_model="
                f"{self.d_model}, d_ff={self.d_ff}, node store ({self.tier} tier), streamed")
