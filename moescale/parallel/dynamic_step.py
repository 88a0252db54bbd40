"""`SharedStoreStep`: the expert-step handle (moescale.expert_step) of dynamic placement.

The experts of a node live in one host store shared by the node's ranks
(parallel/dynamic_experts.py). After backward each rank averages its share of the node's
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

from moescale.parallel.dynamic_experts import step_shared_experts
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
