"""The routing plan: which token goes to which row, grouped by expert, with no dense mask.

Routing choices are flattened k-major (f = k * T + t), so a stable sort by expert id orders the
rows of one expert first by choice rank k, then by token position: exactly the position
priority that capacity uses (every first choice beats every second choice; earlier tokens beat
later ones). Capacity then keeps the first `capacity` rows of each expert's run. One stable
`argsort`, one `bincount`, one host sync (the counts, needed to size the per-expert GEMMs).

Legend: T tokens, K choices per token, E experts, F = K*T flat choices, R kept rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingPlan:
    """Rows grouped by expert. Tensors live on the input's device; `counts` is a host list."""

    num_tokens: int
    token_idx_R: torch.Tensor    # int64 token of each row
    choice_idx_R: torch.Tensor   # int64 flat k-major choice f of each row
    scores_R: torch.Tensor       # fp32 combine weight of each row (carries the router's grad)
    counts_E: torch.Tensor       # int64 rows per expert (after capacity)
    counts: list[int]            # the same, on the host
    routed_E: torch.Tensor       # int64 choices per expert before capacity (load statistics)
    num_dropped: int             # choices that got no row (capacity or the router's own drop)

    @property
    def num_rows(self) -> int:
        return int(self.token_idx_R.shape[0])


def build_plan(scores_TK: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int,
               capacity: int | None = None, check_finite: torch.Tensor | None = None
               ) -> RoutingPlan:
    """Sort routing choices into expert-grouped rows, dropping past `capacity` per expert.

    `check_finite`, if given, is a tensor whose non-finite entries make this raise ValueError;
    its check rides on the same host sync as the counts.
    """
    num_tokens, top_k = expert_ids_TK.shape
    ids_F = expert_ids_TK.t().reshape(-1)
    ids_F = torch.where(ids_F < 0, num_experts, ids_F)  # router drops sort last
    order_F = torch.argsort(ids_F, stable=True)
    routed_with_drop_E = torch.bincount(ids_F, minlength=num_experts + 1)
    routed_E = routed_with_drop_E[:num_experts]
    if capacity is None:
        counts_E = routed_E
    else:
        counts_E = routed_E.clamp(max=capacity)
    sync = [counts_E]
    if check_finite is not None:
        sync.append(torch.isfinite(check_finite).all().reshape(1).long())
    host = torch.cat(sync).tolist()
    if check_finite is not None and not host[-1]:
        raise ValueError(
            "router logits contain NaN or Inf; check the layer input and the router weights "
            "for non-finite values (lower the learning rate or enable gradient clipping)"
        )
    counts = host[:num_experts]
    num_kept = sum(counts)
    if capacity is None:
        order_R = order_F[:num_kept]
    else:
        starts_E = torch.cumsum(routed_with_drop_E, 0) - routed_with_drop_E
        sorted_ids_F = ids_F[order_F]
        pos_F = torch.arange(ids_F.numel(), device=ids_F.device) - starts_E[sorted_ids_F]
        keep_F = (pos_F < capacity) & (sorted_ids_F < num_experts)
        order_R = order_F[keep_F]
    scores_R = scores_TK.t().reshape(-1)[order_R]
    token_idx_R = order_R % max(num_tokens, 1)
    return RoutingPlan(
        num_tokens=num_tokens, token_idx_R=token_idx_R, choice_idx_R=order_R,
        scores_R=scores_R, counts_E=counts_E, counts=counts, routed_E=routed_E,
        num_dropped=num_tokens * top_k - num_kept,
    )
