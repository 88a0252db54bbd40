"""The bench's routing-and-data-movement bound (moescale.bench.layer_bound) computes what it
claims: an MoE on identity experts is y_t = sum over t's rows of score_r * x_t, with exact
gradients for the input and, through the scores, for the router; it shares moescale's
routing (same plan on the same weights)."""

from __future__ import annotations

import pytest
import torch

from moescale.bench.layer_bound import RoutingOnlyExperts, build_movement, routing_only_moe
from moescale.dispatch.plan import build_plan
from moescale.layers.moe import MoE


def _reference(bound, x_TD):
    """Plain autograd: the same routing, then each row's scored input summed per token."""
    route = bound.router(x_TD)
    plan = build_plan(route.scores_TK, route.expert_ids_TK, bound.num_experts)
    rows_RD = x_TD[plan.token_idx_R] * plan.scores_R.to(x_TD.dtype).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, plan.token_idx_R, rows_RD)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_identity_experts_output_and_gradients_match_plain_autograd(top_k):
    torch.manual_seed(top_k)
    moe = MoE(12, 5, top_k, d_ff=24).double()
    bound = routing_only_moe(moe)
    assert torch.equal(bound.router.weight, moe.router.weight)
    x_TD = torch.randn(40, 12, dtype=torch.float64)
    g_TD = torch.randn(40, 12, dtype=torch.float64)
    outs = []
    for fn in (bound, lambda x: _reference(bound, x)):
        x = x_TD.clone().requires_grad_(True)
        bound.zero_grad(set_to_none=True)
        y = fn(x)
        (y * g_TD).sum().backward()
        outs.append((y.detach(), x.grad, bound.router.weight.grad.clone()))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert outs[0][2].abs().sum() > 0     # the router is trained through the scores


def test_movement_candidate_runs_on_bf16_and_uses_moescales_routing():
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, d_ff=32).to(torch.bfloat16)
    x_TD = torch.randn(64, 16).to(torch.bfloat16)
    cand = build_movement(moe, x_TD, torch.randn(64, 16).to(torch.bfloat16))
    assert cand.family == "bound" and cand.rows == 128
    cand.step()
    bound = routing_only_moe(moe)    # the same tokens: the same routing decisions as moescale
    with torch.no_grad():
        moe(x_TD), bound(x_TD)
    assert torch.equal(bound.last_stats.routed_E, moe.last_stats.routed_E)
    assert moe.last_stats.routed_E.sum() == 128
    assert cand.leaves[0].grad is not None and cand.leaves[0].grad.dtype == torch.bfloat16
    cand.reset()
    assert cand.leaves[0].grad is None


def test_container_checks_its_size():
    with pytest.raises(ValueError, match="num_experts=0"):
        RoutingOnlyExperts(0)
    with pytest.raises(ValueError, match="holds 3 experts"):
        MoE(8, 4, 2, experts=RoutingOnlyExperts(3))
