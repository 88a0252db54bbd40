"""`DynamicOffload`: where dynamic placement's experts live when they are offloaded.

The residency half of `moescale train --parallel.placement dynamic --offload.tier host|disk`
(the trainer's assembly applies the exchange first, which puts the node's experts in one host
store in /dev/shm, then `prepare`):
- `host`: that store stays; each MoE layer's experts become `StreamedSharedExperts` over it,
  so each rank uploads only the experts placed on it through its own byte-budgeted device;
- `disk`: the node's ranks write the store's experts into record files under
  `<directory>/node<k>/` (`node_disk_store`), drop the host copy, and stream from the files;
  the step handle fences the ranks' views of the files (node_disk.py).
`prepare` returns the expert-step handle (`StreamedStoreStep`). Checkpoints go through the
expert shards as for the shared store (each local rank saves and loads its block; disk-tier
records hard-linked).

Not here: the exchange (dynamic.py), the container (dynamic_offload.py). Plain arguments
only: the trainer parses its options into them.
"""

from __future__ import annotations

import os

from moescale.layers.moe import MoE
from moescale.shared_store.experts import SharedStoreExperts
from moescale.shared_store.streamed import POLICIES, RankDevice, StreamedSharedExperts
from moescale.shared_store.step import StreamedStoreStep
from moescale.shared_store.node_disk import DiskCoherence, node_disk_store


class DynamicOffload:
    """Dynamic placement's node store streamed through each rank's device (see the module
    docstring). tier: 'host' or 'disk'; directory: the disk tier's root (a node<k>/ folder
    each); device budget in bytes or in experts (fp32 copies of the largest layer's)."""

    kind = "offloaded"
    engine = None          # no per-process offload engine: the node's store is shared

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
        self.store = None
        self.rank_device: RankDevice | None = None

    def expert_device(self) -> str | None:
        return None       # the exchange reads the model's experts into the node's store

    def prepare(self, model, exchange) -> StreamedStoreStep:
        """After `exchange.prepare(model)`: swap every layer's shared-store experts for
        streamed ones over the node's host or disk store; returns the step handle."""
        layout, group = exchange.layout, exchange.groups.ep_group
        store, coherence = exchange.store, None
        if self.tier == "disk":
            if layout.num_nodes > 1:
                raise ValueError(f"offload.tier='disk' with parallel.placement='dynamic' runs "
                                 f"on one node; this run has {layout.num_nodes} nodes of "
                                 f"{layout.node_size} ranks; use offload.tier host")
            store = node_disk_store(exchange.store, group,
                                    os.path.join(self.directory, f"node{layout.node}"),
                                    host_cache_bytes=self.host_cache_bytes)
            coherence = DiskCoherence(store, group)
        self.store = store
        self.rank_device = RankDevice(store, budget_bytes=self.budget_bytes,
                                      budget_experts=self.budget_experts,
                                      lookahead=self.lookahead)
        layers = []
        for moe in model.modules():
            if isinstance(moe, MoE) and isinstance(moe.experts, SharedStoreExperts):
                moe.experts = StreamedSharedExperts.replacing(moe.experts, store,
                                                              self.rank_device, self.policy)
                if coherence is not None:   # evaluation or sampling right after a load
                    moe.experts.before_inference = coherence.fence_if_changed
                layers.append(moe.experts)
        assert [x.layer_index for x in layers] == list(range(len(layers)))
        exchange.layers, exchange.store = layers, store    # the host copy goes (disk tier)
        return StreamedStoreStep(layers, layout, exchange.groups, self.rank_device, coherence)

    def describe(self, device) -> tuple[str, str]:
        from moescale.offload.planner import fmt_bytes

        numel = max(lay.numel for lay in self.store.layouts)
        budget = self.rank_device.device.budget_bytes
        where = "the node's host store (/dev/shm)" if self.tier == "host" else \
            f"the node's expert files ({self.store.config.directory})"
        return self.mode, (f"experts streamed from {where} through each rank's device budget "
                           f"of {fmt_bytes(budget)} = {budget / (4 * numel):.1f} experts "
                           f"(fp32), activations {self.policy}, steps after backward by each "
                           "expert's owner")

    def close(self) -> None:
        if self.store is not None and self.tier == "disk":
            self.store.close()
        self.store = None
