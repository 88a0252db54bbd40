"""Local dispatch: gather rows by expert, run the experts on this process, combine.

This is the single-process exchange that the expert-parallel dispatchers replace. Containers
declaring ROUTED (moescale.dispatch.protocol: stacked and offloaded experts) take their fused path
(gather, experts and combine in one autograd Function); any other container gets rows through
`index_select` and returns them through a weighted `index_add`.
No dense [T, E, C] mask anywhere.

Legend: T tokens, R rows (kept routing choices, grouped by expert), D model width.
"""

from __future__ import annotations

import torch

from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import ROUTED, capabilities_of


def gather_rows(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """x_RD: each row a copy of its token (differentiable)."""
    return x_TD.index_select(0, plan.token_idx_R)


def combine_rows(y_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """y_TD = sum of score-weighted rows per token; tokens with no row get zero."""
    weighted_RD = y_RD * plan.scores_R.to(y_RD.dtype).unsqueeze(1)
    out_TD = y_RD.new_zeros(plan.num_tokens, y_RD.shape[1])
    return out_TD.index_add(0, plan.token_idx_R, weighted_RD)


class LocalDispatcher:
    """All experts live here; statistics need no reduction."""

    def __call__(self, x_TD: torch.Tensor, plan: RoutingPlan, experts) -> torch.Tensor:
        if ROUTED in capabilities_of(experts):
            return experts.forward_routed(x_TD, plan)
        y_RD = experts.forward_rows(gather_rows(x_TD, plan), plan.counts)
        return combine_rows(y_RD, plan)

    def reduce_sum(self, stats: torch.Tensor) -> torch.Tensor:
        return stats
