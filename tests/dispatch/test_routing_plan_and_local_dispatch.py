"""The routing plan and the local dispatch seam.

Proves: `build_plan` groups rows by expert in position-priority order (all first choices in
token order, then all second choices, ...), keeps exactly the rows a brute-force walk keeps
under capacity (and the same as the reference's keep mask), counts routed / kept / dropped
choices, is deterministic and independent of the score values; the non-fused seam
(`gather_rows` -> `GroupedExperts.forward_rows` -> `combine_rows`) equals the fused
`forward_routed` path in outputs and all gradients, and the module-expert path through
`LocalDispatcher` equals the grouped path with the same weights.

Legend: T tokens, D model width, F hidden width, E experts, K choices per token, R rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moescale import GroupedExperts, MoE, ModuleExperts, ReferenceMoE
from moescale.dispatch.local import LocalDispatcher, combine_rows, gather_rows
from moescale.dispatch.plan import build_plan

D_MODEL, D_FF = 16, 32
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def random_routing(num_tokens, num_experts, top_k, seed=0, router_drops=False):
    """Distinct expert ids per token and positive scores, optionally with -1 slots."""
    gen = torch.Generator().manual_seed(seed)
    ids_TK = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    if router_drops and top_k > 1:
        ids_TK[torch.rand(num_tokens, generator=gen) < 0.3, -1] = -1
    scores_TK = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return scores_TK, ids_TK


def brute_force_rows(ids_TK, num_experts, capacity):
    """Rows as (expert, k, t) walking experts, then k, then t; capacity per expert."""
    num_tokens, top_k = ids_TK.shape
    rows = []
    for e in range(num_experts):
        mine = [(k, t) for k in range(top_k) for t in range(num_tokens) if ids_TK[t, k] == e]
        rows += [(e, k, t) for k, t in (mine if capacity is None else mine[:capacity])]
    return rows


PLAN_CASES = [pytest.param(t, e, k, cap, drops, id=f"T{t}-E{e}-k{k}-cap{cap}-drops{drops}")
              for t, e, k in ((20, 1, 1), (33, 4, 2), (64, 16, 4), (40, 4, 4))
              for cap in (None, 0.25, 0.5, 1.0, 2.0)
              for drops in (False, True) if not (drops and k == 1)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,capacity_factor,router_drops",
                         PLAN_CASES)
def test_plan_rows_equal_brute_force_position_priority_walk(num_tokens, num_experts, top_k,
                                                            capacity_factor, router_drops):
    scores_TK, ids_TK = random_routing(num_tokens, num_experts, top_k, router_drops=router_drops)
    capacity = None if capacity_factor is None else \
        math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    plan = build_plan(scores_TK, ids_TK, num_experts, capacity)
    rows = brute_force_rows(ids_TK, num_experts, capacity)
    assert plan.num_rows == len(rows) == sum(plan.counts)
    assert plan.choice_idx_R.tolist() == [k * num_tokens + t for _, k, t in rows]
    assert plan.token_idx_R.tolist() == [t for _, _, t in rows]
    assert plan.scores_R.tolist() == [scores_TK[t, k].item() for _, k, t in rows]
    assert plan.counts == plan.counts_E.tolist() == \
        [sum(1 for e, _, _ in rows if e == x) for x in range(num_experts)]
    valid = ids_TK[ids_TK >= 0]
    assert plan.routed_E.tolist() == torch.bincount(valid, minlength=num_experts).tolist()
    assert plan.num_dropped == num_tokens * top_k - len(rows)
    assert plan.num_tokens == num_tokens


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0, 1.5])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 2), (16, 4)])
def test_plan_keeps_exactly_the_reference_keep_mask(num_experts, top_k, capacity_factor):
    moe = MoE(D_MODEL, num_experts, top_k, d_ff=8, capacity_factor=capacity_factor)
    scores_TK, ids_TK = random_routing(48, num_experts, top_k, seed=5)
    capacity = math.ceil(capacity_factor * 48 * top_k / num_experts)
    plan = build_plan(scores_TK, ids_TK, num_experts, capacity)
    keep_F = torch.zeros(48 * top_k, dtype=torch.bool)
    keep_F[plan.choice_idx_R] = True
    expected_TK = ReferenceMoE(moe).keep_mask(ids_TK)
    assert torch.equal(keep_F.view(top_k, 48).t(), expected_TK)
    assert plan.num_dropped == int((~expected_TK).sum())


def test_plan_is_deterministic_and_capacity_ignores_score_values():
    scores_TK, ids_TK = random_routing(64, 4, 2, seed=7)
    first = build_plan(scores_TK, ids_TK, 4, capacity=20)
    again = build_plan(scores_TK.clone(), ids_TK.clone(), 4, capacity=20)
    reversed_scores = build_plan(scores_TK.flip(0), ids_TK, 4, capacity=20)
    for plan in (again, reversed_scores):
        assert torch.equal(plan.choice_idx_R, first.choice_idx_R)
        assert torch.equal(plan.token_idx_R, first.token_idx_R)
        assert plan.counts == first.counts
    assert first.num_dropped > 0


def test_plan_of_an_empty_batch_has_no_rows():
    plan = build_plan(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long), 4, capacity=0)
    assert plan.num_rows == 0 and plan.counts == [0, 0, 0, 0] and plan.num_dropped == 0


def test_plan_rejects_non_finite_router_logits():
    scores_TK, ids_TK = random_routing(8, 4, 2)
    logits_TE = torch.zeros(8, 4)
    logits_TE[2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_plan(scores_TK, ids_TK, 4, check_finite=logits_TE)


# --- the dispatch seam ----------------------------------------------------------------------

def make_experts(num_experts, glu, bias, seed=0) -> GroupedExperts:
    torch.manual_seed(seed)
    return GroupedExperts(num_experts, D_MODEL, D_FF, glu=glu, bias=bias)


def run_dispatch(fn, experts, x_TD, scores_TK, ids_TK, capacity, grad_TD, autocast=False):
    """Output and grads (x, scores, every expert weight) of fn(x_TD, plan, experts)."""
    x_TD = x_TD.detach().requires_grad_(True)
    scores_TK = scores_TK.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plan = build_plan(scores_TK, ids_TK, experts.num_experts, capacity)
        y_TD = fn(x_TD, plan, experts)
    params = list(experts.parameters())
    grads = torch.autograd.grad((y_TD.float() * grad_TD).sum(), [x_TD, scores_TK] + params)
    return y_TD.detach(), grads


def fused(x_TD, plan, experts):
    return experts.forward_routed(x_TD, plan)


def unfused(x_TD, plan, experts):
    return combine_rows(experts.forward_rows(gather_rows(x_TD, plan), plan.counts), plan)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("capacity", [None, 6])
@pytest.mark.parametrize("glu,bias", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 2), (16, 4)])
def test_unfused_forward_rows_seam_equals_fused_forward_routed(moe_helpers, num_experts, top_k,
                                                               glu, bias, capacity, autocast):
    experts = make_experts(num_experts, glu, bias)
    scores_TK, ids_TK = random_routing(24, num_experts, top_k, seed=2, router_drops=True)
    gen = torch.Generator().manual_seed(3)
    x_TD, grad_TD = torch.randn(24, D_MODEL, generator=gen), torch.randn(24, D_MODEL,
                                                                         generator=gen)
    y_fused, g_fused = run_dispatch(fused, experts, x_TD, scores_TK, ids_TK, capacity, grad_TD,
                                    autocast)
    y_rows, g_rows = run_dispatch(unfused, experts, x_TD, scores_TK, ids_TK, capacity, grad_TD,
                                  autocast)
    rtol = moe_helpers.BF16_RTOL if autocast else moe_helpers.FP32_RTOL
    moe_helpers.assert_scaled_close(y_rows, y_fused, rtol, "output")
    names = ["x", "scores"] + [n for n, _ in experts.named_parameters()]
    for name, a, b in zip(names, g_rows, g_fused):
        moe_helpers.assert_scaled_close(a, b, rtol, f"grad of {name}")


def test_forward_rows_equals_expert_forward_on_each_segment():
    experts = make_experts(4, glu=True, bias=False)
    counts = [3, 0, 5, 2]
    x_RD = torch.randn(sum(counts), D_MODEL, generator=torch.Generator().manual_seed(4))
    y_RD = experts.forward_rows(x_RD, counts)
    start = 0
    for e, n in enumerate(counts):
        torch.testing.assert_close(y_RD[start:start + n],
                                   experts.expert_forward(e, x_RD[start:start + n]))
        start += n


def as_modules(experts: GroupedExperts) -> ModuleExperts:
    """The same FFN experts as nn.Linear-GELU-nn.Linear modules (copied weights)."""
    modules = []
    for e in range(experts.num_experts):
        m = nn.Sequential(nn.Linear(D_MODEL, D_FF), nn.GELU(), nn.Linear(D_FF, D_MODEL))
        with torch.no_grad():
            m[0].weight.copy_(experts.w1_EDF[e].t())
            m[0].bias.copy_(experts.b1_EF[e])
            m[2].weight.copy_(experts.w2_EFD[e].t())
            m[2].bias.copy_(experts.b2_ED[e])
        modules.append(m)
    return ModuleExperts(modules)


@pytest.mark.parametrize("capacity", [None, 5])
def test_local_dispatcher_module_path_equals_grouped_path(moe_helpers, capacity):
    grouped = make_experts(4, glu=False, bias=True)
    modules = as_modules(grouped)
    scores_TK, ids_TK = random_routing(20, 4, 2, seed=9)
    gen = torch.Generator().manual_seed(1)
    x_TD, grad_TD = torch.randn(20, D_MODEL, generator=gen), torch.randn(20, D_MODEL,
                                                                         generator=gen)
    dispatcher = LocalDispatcher()
    y_grouped, g_grouped = run_dispatch(dispatcher, grouped, x_TD, scores_TK, ids_TK, capacity,
                                        grad_TD)
    y_modules, g_modules = run_dispatch(dispatcher, modules, x_TD, scores_TK, ids_TK, capacity,
                                        grad_TD)
    moe_helpers.assert_scaled_close(y_modules, y_grouped, moe_helpers.FP32_RTOL, "output")
    for name, a, b in zip(["x", "scores"], g_modules[:2], g_grouped[:2]):
        moe_helpers.assert_scaled_close(a, b, moe_helpers.FP32_RTOL, f"grad of {name}")
    # Expert weight grads: module e's Linear grads are the transposed slices of the stack.
    w1, w2, b1, b2 = g_grouped[2:]
    for e, m in enumerate(modules.experts):
        got = g_modules[2 + 4 * e: 6 + 4 * e]
        for a, b in zip(got, (w1[e].t(), b1[e], w2[e].t(), b2[e])):
            moe_helpers.assert_scaled_close(a, b, moe_helpers.FP32_RTOL, f"expert {e}")
    assert dispatcher.reduce_sum(torch.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
