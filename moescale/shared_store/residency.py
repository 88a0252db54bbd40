"""Where dynamic placement's experts live: the residencies over the node's shared store.

The residency half of `moescale train --parallel.placement dynamic` (the trainer's assembly
applies the exchange first, which only gives every MoE layer a DynamicPlacementDispatcher, then
the residency's `prepare`, which puts the node's experts in one host store in /dev/shm:
`share_node_experts`):
- `SharedResident` (offload.tier device-only): the experts are computed in place on that host
  copy (`SharedStoreExperts`); its step handle `SharedStoreStep` has each expert stepped by its
  owner between the node's barriers;
- `DynamicOffload` (offload.tier host | disk), streamed:
- `host`: that store stays; each MoE layer's experts become `StreamedSharedExperts` over it,
  so each rank uploads only the experts placed on it through its own byte-budgeted device;
- `disk`: the node's ranks write the store's experts into record files under
  `<directory>/node<k>/` (`node_disk_store`), drop the host copy, and stream from the files;
  the step handle fences the ranks' views of the files (node_disk.py).
`prepare` returns the expert-step handle (`StreamedStoreStep`). Checkpoints of either go
through the expert shards with `share` (`shard_role`: each of node 0's ranks saves and loads
its block; disk-tier records hard-linked). Both satisfy moescale.train.parts.Residency.

Not here: the exchange (parallel/dynamic.py, train/exchange.py), the containers
(experts.py, streamed.py). Plain arguments only: the trainer parses its options into them.
"""

from __future__ import annotations

import os

from moescale.layers.moe import MoE
from moescale.sizes import fmt_bytes
from moescale.shared_store.experts import SharedStoreExperts, grouped_experts_of
from moescale.shared_store.node_disk import DiskCoherence, node_disk_store
from moescale.shared_store.node_store import node_expert_store
from moescale.shared_store.step import SharedStoreStep, StreamedStoreStep
from moescale.shared_store.streamed import POLICIES, RankDevice, StreamedSharedExperts


def share_node_experts(model, exchange) -> tuple:
    """Collective over the node (exchange.groups.ep_group): the node's store of every MoE
    layer's experts (layer i = the model's i-th MoE) in /dev/shm, and each layer's experts
    replaced by `SharedStoreExperts` over it. Returns (store, layers)."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    store = node_expert_store(moes, exchange.groups.ep_group, node=exchange.layout.node)
    layers = []
    for i, moe in enumerate(moes):
        x = grouped_experts_of(moe, "dynamic placement")
        moe.experts = SharedStoreExperts(store, i, x.d_model, x.d_ff, x.act, x.glu,
                                         x.b1_EF is not None)
        layers.append(moe.experts)
    return store, layers


def node_share(exchange) -> tuple[bool, tuple[int, int]]:
    """shard_role of a node store: node 0's ranks write it (every node holds the same
    replica), each its block."""
    layout = exchange.layout
    return layout.node == 0, (layout.local_rank, layout.node_size)


class SharedResident:
    """Dynamic placement's experts computed in place on the node's host copy (see the module
    docstring)."""

    engine = None          # no per-process offload engine: the node's store is shared
    streams_experts = False

    def __init__(self) -> None:
        self.store, self.layers, self.layout = None, [], None

    def expert_device(self) -> str | None:
        return None       # the node's store is read from the model's experts

    def prepare(self, model, exchange) -> SharedStoreStep:
        self.store, self.layers = share_node_experts(model, exchange)
        self.layout = exchange.layout
        return SharedStoreStep(self.layers, self.layout, exchange.groups)

    def shard_role(self, exchange) -> tuple[bool, tuple[int, int]]:
        return node_share(exchange)

    def describe(self, device, where: str) -> tuple[str, str]:
        nbytes = sum(x.records().numel() * 4 for x in self.layers)
        nodes = self.layout.num_nodes
        replicas = "" if nodes == 1 else (f" on each of {nodes} nodes (replicas, gradients "
                                          f"averaged across nodes)")
        return "device-only", (f"device-only, experts in one host copy shared by the "
                               f"{self.layout.node_size} local ranks{replicas} "
                               f"({fmt_bytes(nbytes)} in /dev/shm: weights, gradients, AdamW "
                               f"moments), {where} on {device}")

    def close(self) -> None:
        self.store = None    # the mapping goes with the last reference (the file is gone)


class DynamicOffload:
    """Dynamic placement's node store streamed through each rank's device (see the module
    docstring). tier: 'host' or 'disk'; directory: the disk tier's root (a node<k>/ folder
    each); device budget in bytes or in experts (fp32 copies of the largest layer's)."""

    engine = None          # no per-process offload engine: the node's store is shared
    streams_experts = True

    def __init__(self, *, tier: str, directory: str | None = None,
                 device_budget_bytes: int | None = None,
                 device_budget_experts: float | None = None,
                 host_cache_bytes: int | None = None, activation_policy: str = "keep",
                 lookahead: int = 1, mode: str | None = None) -> None:
        if tier not in ("host", "disk"):
            raise ValueError(f"dynamic placement streams experts from a host or disk store, "
                             f"not tier {tier!r}; use offload.tier host or disk")
        if tier == "disk" and not directory:
            raise ValueError("the disk tier needs a directory for the node's expert files")
        if activation_policy not in POLICIES:
            raise ValueError(f"offload.activation_policy={activation_policy!r} is not supported "
                             f"with dynamic placement; use one of {', '.join(POLICIES)}")
        if device_budget_bytes is None and device_budget_experts is None:
            device_budget_experts = 3.0    # double-buffered uploads, and a gradient
        self.tier, self.directory, self.mode = tier, directory, mode or tier
        self.budget_bytes, self.budget_experts = device_budget_bytes, device_budget_experts
        self.host_cache_bytes, self.policy, self.lookahead = host_cache_bytes, \
            activation_policy, lookahead
        self.store, self.layers, self.layout = None, [], None
        self.rank_device: RankDevice | None = None

    def expert_device(self) -> str | None:
        return None       # the exchange reads the model's experts into the node's store

    def prepare(self, model, exchange) -> StreamedStoreStep:
        """After `exchange.prepare(model)`: the node's host store (`share_node_experts`), then
        every layer's experts streamed over it or over the disk store written from it; returns
        the step handle."""
        layout, group = exchange.layout, exchange.groups.ep_group
        host_store, shared = share_node_experts(model, exchange)
        store, coherence = host_store, None
        if self.tier == "disk":
            if layout.num_nodes > 1:
                raise ValueError(f"offload.tier='disk' with parallel.placement='dynamic' runs "
                                 f"on one node; this run has {layout.num_nodes} nodes of "
                                 f"{layout.node_size} ranks; use offload.tier host")
            store = node_disk_store(host_store, group,
                                    os.path.join(self.directory, f"node{layout.node}"),
                                    host_cache_bytes=self.host_cache_bytes)
            coherence = DiskCoherence(store, group)
        self.store = store
        self.rank_device = RankDevice(store, budget_bytes=self.budget_bytes,
                                      budget_experts=self.budget_experts,
                                      lookahead=self.lookahead)
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        for moe, layer in zip(moes, shared):
            moe.experts = StreamedSharedExperts.replacing(layer, store, self.rank_device,
                                                          self.policy)
            if coherence is not None:   # evaluation or sampling right after a load
                moe.experts.before_inference = coherence.fence_if_changed
        self.layers = [m.experts for m in moes]
        self.layout = layout
        del host_store, shared               # the host copy goes (disk tier)
        return StreamedStoreStep(self.layers, layout, exchange.groups, self.rank_device,
                                 coherence)

    def shard_role(self, exchange) -> tuple[bool, tuple[int, int]]:
        return node_share(exchange)

    def describe(self, device, where: str) -> tuple[str, str]:
        numel = max(lay.numel for lay in self.store.layouts)
        budget = self.rank_device.device.budget_bytes
        where = "the node's host store (/dev/shm)" if self.tier == "host" else \
            f"the node's expert files ({self.store.config.directory})"
        return self.mode, (f"experts streamed from {where} through each rank's device budget "
                           f"of {fmt_bytes(budget)} = {budget / (4 * numel):.1f} experts "
                           f"(fp32), activations {self.policy}, steps after backward by each "
                           f"expert's owner; {where} on the node's ranks")

    def close(self) -> None:
        if self.store is not None and self.tier == "disk":
            self.store.close()
        self.store = None
