"""`SharedStoreStep`: the expert-step handle (moescale.expert_step) of dynamic placement.

The experts of a node live in one host store shared by the node's ranks
(shared_store/experts.py). After backward each rank averages its share of the node's
expert gradient accumulators over the nodes (`average_across_nodes`: the node accumulators
hold node-mean gradients; their mean is the gradient of the mean loss over all tokens); the
global norm counts the dense part once plus every expert's accumulator once (the shares are
disjoint within a node) and scales both, as the single-process `clip_grad_norm_` over every
parameter would. `step` runs `step_shared_experts` over the node group with the dense
optimizer's current lr, betas, eps and weight decay: each expert is stepped once per node, by
its owner, between two barriers; the nodes step equal gradients with equal state, so their
replicas stay bitwise equal. `skip_step` keeps the fence and only zeroes the accumulators.
"""

from __future__ import annotations

import math

from moescale.shared_store.experts import step_shared_experts
from moescale.parallel.grad_sync import clip_grad_norm_
from moescale.parallel.nodes import average_across_nodes


class SharedStoreStep:
    """The ExpertStep of node-shared-store experts (see the module docstring)."""

    def __init__(self, layers, layout, groups) -> None:
        self.layers, self.layout, self.groups = layers, layout, groups
        self.optimizer = None

    def follow(self, optimizer) -> None:
        self.optimizer = optimizer

    def begin_micro_batch(self, last: bool) -> None:
        pass

    def before_backward(self, loss) -> None:
        pass

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        mine = average_across_nodes(self.layers, self.layout, self.groups.dp_group)
        return float(clip_grad_norm_(model, max_norm if max_norm > 0 else math.inf,
                                     self.groups, extra_grads=mine))

    def skipped_steps(self) -> int:
        return 0

    def take_wait_s(self) -> float:
        return 0.0        # computed in place in the node's host store: no uploads

    def step(self) -> None:
        group = self.optimizer.param_groups[0]
        # its first barrier: every share is averaged and clipped before any owner steps
        step_shared_experts(self.layers, self.groups.ep_group, lr=group["lr"],
                            betas=tuple(group["betas"]), eps=group["eps"],
                            weight_decay=group["weight_decay"])

    def skip_step(self) -> None:
        # the same fence, no step: each owner zeroes its experts' accumulators
        step_shared_experts(self.layers, self.groups.ep_group, lr=0.0, skip=True)

    def memory(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class StreamedStoreStep(SharedStoreStep):
    """The ExpertStep of a node's store streamed through each rank's device
    (streamed.py). Host tier: the shared store's step as above. Disk tier (`coherence`
    given): every micro-batch starts with a fence (the previous pass's gradients in the files,
    one view of them on every rank); clipping fences, then counts this rank's share of the
    accumulators (read from the files) and scales them at the step; the step ends with a
    fence instead of its closing barrier. One node only on the disk tier."""

    def __init__(self, layers, layout, groups, rank_device, coherence=None) -> None:
        super().__init__(layers, layout, groups)
        if coherence is not None and layout.num_nodes > 1:
            raise ValueError(f"dynamic placement over a disk-tier store runs on one node; this "
                             f"run has {layout.num_nodes} (parallel.node_size "
                             f"{layout.node_size}); use offload.tier host across nodes")
        self.rank_device, self.coherence = rank_device, coherence
        self._coef: float | None = None

    def begin_micro_batch(self, last: bool) -> None:
        if self.coherence is not None:
            self.coherence.fence()

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        if self.coherence is None:
            return super().clip_grad_norm_(model, max_norm)
        from moescale.parallel.nodes import node_share

        self.coherence.fence()
        pairs = node_share([x.num_experts for x in self.layers], self.layout.local_rank,
                           self.layout.node_size)
        sq = self.coherence.grad_sq([(self.layers[i].layer_index, e) for i, e in pairs])
        limit = max_norm if max_norm > 0 else math.inf
        total = clip_grad_norm_(model, limit, self.groups, extra_grads=[sq.sqrt().reshape(1)])
        self._coef = float((limit / (total + 1e-6)).clamp(max=1.0))
        return float(total)

    def step(self) -> None:
        if self.coherence is None:
            return super().step()
        group = self.optimizer.param_groups[0]
        coef, self._coef = self._coef, None
        if coef is None:            # not clipped: the last pass's gradients are not fenced yet
            self.coherence.fence()
        step_shared_experts(self.layers, self.groups.ep_group, lr=group["lr"],
                            betas=tuple(group["betas"]), eps=group["eps"],
                            weight_decay=group["weight_decay"], grad_coef=coef,
                            fence=self.coherence.fence)

    def skip_step(self) -> None:
        if self.coherence is None:
            return super().skip_step()
        if self._coef is None:
            self.coherence.fence()
        self._coef = None
        step_shared_experts(self.layers, self.groups.ep_group, lr=0.0, skip=True,
                            fence=self.coherence.fence)

    def take_wait_s(self) -> float:
        return self.rank_device.cache.take_wait_s()

    def memory(self) -> dict:
        out = self.rank_device.memory()
        store = self.layers[0].store if self.layers else None
        if store is not None and store.config.tier == "disk":
            out["disk_read_bytes"] = int(store.bytes_read)
            out["disk_written_bytes"] = int(store.bytes_written)
        return out
