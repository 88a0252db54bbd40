"""Dynamic placement over offloaded experts: a node's store streamed through each rank's device.

The node's ranks share one ExpertStore: the host tier in /dev/shm (`node_expert_store`) or the
disk tier in a directory of the node (`node_disk_store`, node_disk.py). Each iteration LPT
assigns experts (and shards of hot ones) to the ranks as before (parallel/dynamic.py); a rank
uploads only the experts it was assigned, one after another, through its own byte-budgeted device
(`make_device`) and `DeviceCache` (upload of expert i+1 overlapped with expert i's compute),
computes with the compute copy and drops it.

`StreamedSharedExperts` is the expert container of one layer (PLACED, STREAMED, FFN_SHAPE; no
parameters), called as `forward_placed(x_RD, counts_E, owners_E, split_experts, group)`:
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
from moescale.layers.grouped_ffn import FFNWeights, ffn_backward, ffn_forward
from moescale.offload.cache import DeviceCache
from moescale.offload.chunked import row_starts
from moescale.offload.records import G
from moescale.offload.store import ExpertStore
from moescale.offload.store_access import StoreAccess
from moescale.parallel.all_to_all import collective_errors
from moescale.shared_store.experts import PARAM_NAMES, SharedStoreExperts

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


class _StreamedFn(torch.autograd.Function):
    """The experts with rows here, streamed one at a time; gradients into the store."""

    @staticmethod
    def forward(ctx, anchor, x_RD, layer: "StreamedSharedExperts", counts: tuple,
                owners: tuple, split: tuple, group):
        starts = row_starts(counts)
        active = [e for e, n in enumerate(counts) if n]
        keep = layer.policy == "keep"
        y_RD = x_RD.new_empty(x_RD.shape[0], layer.d_model)
        saved = {}
        for e, w_P in layer.rank_device.cache.walk(layer.layer_index, active):
            s, n = starts[e], counts[e]
            y_ND, h1_NF, h3_NF = ffn_forward(x_RD[s:s + n], (n,), layer.weights(w_P), layer.act)
            y_RD[s:s + n] = y_ND
            if keep:
                saved[e] = (h1_NF, h3_NF)
            del w_P
        ctx.layer, ctx.counts, ctx.owners, ctx.split, ctx.group = layer, counts, owners, \
            split, group
        ctx.active, ctx.saved = active, saved
        ctx.save_for_backward(x_RD)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        (x_RD,) = ctx.saved_tensors
        layer, counts, saved = ctx.layer, ctx.counts, ctx.saved
        need_dx = ctx.needs_input_grad[1]
        gy_RD = gy_RD.contiguous()
        dx_RD = torch.zeros_like(x_RD) if need_dx else None
        starts = row_starts(counts)
        rank = dist.get_rank(ctx.group)
        numel = layer.layout.numel
        slot = {e: i for i, e in enumerate(ctx.split)}
        buf_SP = torch.zeros(len(ctx.split), numel, dtype=torch.float32)
        device = layer.rank_device.device
        for e, w_P in layer.rank_device.cache.walk(layer.layer_index, reversed(ctx.active),
                                                   headroom=4 * numel):
            s, n = starts[e], counts[e]
            grad_res = device.reserve(4 * numel, f"gradient of expert {(layer.layer_index, e)}",
                                      block=True)
            try:
                w = layer.weights(w_P)
                x_ND = x_RD[s:s + n]
                h1_NF, h3_NF = saved.pop(e, None) or ffn_forward(x_ND, (n,), w, layer.act)[1:]
                dx_ND, gw, _ = ffn_backward(gy_RD[s:s + n], x_ND, h1_NF, h3_NF, (n,), w,
                                            layer.act, need_dx=need_dx)
                g_P = torch.cat([getattr(gw, name).reshape(-1).float()
                                 for name in layer.layout.names])
            finally:
                grad_res.release()
            del w_P
            if need_dx:
                dx_RD[s:s + n] = dx_ND
            if e in slot:
                buf_SP[slot[e]] = g_P
            else:
                assert ctx.owners[e] == rank, (e, ctx.owners[e], rank)
                layer.accumulate(e, g_P)
        if ctx.split:
            with collective_errors("split-expert gradient all-reduce", ctx.group):
                dist.all_reduce(buf_SP, group=ctx.group)
            for i, e in enumerate(ctx.split):
                if ctx.owners[e] == rank:
                    layer.accumulate(e, buf_SP[i])
        ctx.saved = None
        return None, dx_RD, None, None, None, None, None


class StreamedSharedExperts(nn.Module):
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

    def weights(self, w_P: torch.Tensor) -> FFNWeights:
        """Single-expert FFNWeights ([1, ...] views) over a flat compute copy."""
        parts = self.layout.split(w_P)
        return FFNWeights(*(parts[n].unsqueeze(0) if n in parts else None for n in PARAM_NAMES))

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
        anchor = self.anchor if torch.is_grad_enabled() else self.anchor.detach()
        return _StreamedFn.apply(anchor, x_RD.float().contiguous(), self, tuple(counts),
                                 tuple(owners_E), tuple(split_experts), group)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        raise ValueError("StreamedSharedExperts runs under a DynamicPlacementDispatcher (it "
                         "needs the placement's owners)")

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
