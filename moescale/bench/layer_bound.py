"""The MoE work outside the experts, timed alone: a lower bound beside the floor.

The floor (layer_impls.build_floor) is the routed rows' FFN work and nothing else. Any dropless
top-k MoE also routes (the gate GEMM in fp32, softmax, top-k, sorting the choices into
expert-grouped rows), gathers each row's token input, weights each row's output by its score
and sums a token's rows back, and in backward gathers the output gradient per row, takes the
score gradient <g_r, y_r>, sums the input gradient back per token and runs the gate's backward.
`build_movement` times exactly that (the output gradient seeded directly, without a
loss pass): moescale's own `MoE` (same router, same routing plan,
same local dispatcher, same row gather `index_select` and per-token combine `gather_sum`) on
experts that are the identity (`RoutingOnlyExperts`). Its score gradient is the cheapest form
(a row dot over D, not the F-wide one a memory-bounded layer computes), and it saves nothing
an expert would need.

So (floor + movement) / floor is what a dropless MoE built from these ops reaches if its
expert work costs exactly the floor's: the report prints it next to moescale's ratio. Where
it exceeds `FLOOR_TIME_TARGET`, the target asks for expert work cheaper than the floor's own
GEMM chains (grouped kernels can be: a bound on the MoE parts, not on the whole layer).

Legend: T tokens, R routed rows, D model width, J rows per token (top-k).
"""

from __future__ import annotations

import torch
from torch import nn

from moescale.bench.layer_impls import Candidate
from moescale.bench.stats import paired_ratio
from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import ROUTED
from moescale.layers.grouped_ffn_autograd import gather_sum, rows_with_zero, token_slots
from moescale.layers.moe import MoE


class _Movement(torch.autograd.Function):
    """y_TD = sum over rows r of token t: scores_r * x_TD[t] (identity experts)."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, token_idx_R):
        num_rows = token_idx_R.shape[0]
        inv_JT = token_slots(token_idx_R, x_TD.shape[0])
        rows_XD = rows_with_zero(num_rows, x_TD.shape[1], x_TD, x_TD.dtype)
        torch.index_select(x_TD, 0, token_idx_R, out=rows_XD[:num_rows])
        rows_XD[:num_rows].mul_(scores_R.to(x_TD.dtype).unsqueeze(1))
        ctx.save_for_backward(x_TD, scores_R, token_idx_R, inv_JT)
        return gather_sum(rows_XD, inv_JT)

    @staticmethod
    def backward(ctx, gy_TD):
        x_TD, scores_R, token_idx_R, inv_JT = ctx.saved_tensors
        num_rows = token_idx_R.shape[0]
        gy_TD = gy_TD.contiguous()
        g_XD = rows_with_zero(num_rows, gy_TD.shape[1], gy_TD, gy_TD.dtype)
        g_RD = torch.index_select(gy_TD, 0, token_idx_R, out=g_XD[:num_rows])
        dscale_R = None
        if ctx.needs_input_grad[1]:
            x_RD = x_TD.index_select(0, token_idx_R)
            dscale_R = torch.linalg.vecdot(g_RD, x_RD).to(scores_R.dtype)
        dx_TD = None
        if ctx.needs_input_grad[0]:
            g_RD.mul_(scores_R.to(g_RD.dtype).unsqueeze(1))
            dx_TD = gather_sum(g_XD, inv_JT)
        return dx_TD, dscale_R, None


class RoutingOnlyExperts(nn.Module):
    """An expert container whose experts are the identity (moescale.dispatch.protocol): an MoE
    built on it does the routing and the data movement of a dropless layer, and no expert
    work."""

    capabilities = frozenset({ROUTED})

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        self.num_experts = num_experts

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def forward_rows(self, x_RD: torch.Tensor, counts_E) -> torch.Tensor:
        return x_RD

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND

    def forward_routed(self, x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return _Movement.apply(x_TD.contiguous(), plan.scores_R, plan.token_idx_R)


def routing_only_moe(moe: MoE) -> MoE:
    """`moe`'s router (a copy of its weights) and configuration on identity experts."""
    bound = MoE(config=moe.config, experts=RoutingOnlyExperts(moe.num_experts))
    param = next(moe.router.parameters())
    bound.router.to(param.device, param.dtype)
    bound.router.load_state_dict(moe.router.state_dict())
    return bound


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands `g` to `y` as its gradient: backward as from the loss
    (y * g).sum(), without the loss's own passes over y (the floor pays those already)."""

    @staticmethod
    def forward(ctx, y, g):
        ctx.save_for_backward(g)
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        return g, None


def build_movement(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor) -> Candidate:
    bound = routing_only_moe(moe)
    x_TD = x_TD.detach().requires_grad_(True)
    params = list(bound.parameters())

    def forward():
        return _Seed.apply(bound(x_TD), g_TD)

    return Candidate(name="bound: routing + data movement", family="bound", forward=forward,
                     leaves=[x_TD] + params, params=params, tokens=x_TD.shape[0],
                     rows=x_TD.shape[0] * moe.config.top_k,
                     note="moescale's router and combine on identity experts",
                     loss_weights=[g_TD])


def movement_bound(rows: list[dict], floor: dict) -> dict | None:
    """(floor + routing and data movement alone) / floor, per paired repetition (see
    layer_bound.py): the step-time ratio a dropless MoE reaches here when its expert work
    costs exactly the floor's."""
    move = next((r for r in rows if r["family"] == "bound"), None)
    if move is None or min(move["runs"], floor["runs"]) < 2:
        return None
    summed = [f + m for f, m in zip(floor["times_ms"], move["times_ms"])]
    return paired_ratio(summed, floor["times_ms"]).as_dict()
