"""Routers and router losses on their own: the rules, the randomness, the loss scales.

Proves: top-k is softmax-then-top-k with (optional) renormalisation; noisy top-k, Switch jitter
and GShard random routing draw randomness only while training; GShard keeps the second expert
with probability min(1, 2 * g2); router math stays fp32 under bf16; the balance loss has the
canonical scale (exactly 1.0 for a uniform router, E when one expert takes everything) and
its statistics reduce over a group as one big batch would; z-loss is the mean squared
log-partition. Layer-level parity with the reference lives in tests/layers.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch

from moescale import MoE, Router, RouterConfig
from moescale.routing.config import expert_capacity
from moescale.routing.losses import balance_loss, z_loss
from moescale.routing.routers import top_k_lowest_index

D_MODEL = 16
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_router(kind="topk", num_experts=4, top_k=2, seed=0, **kw) -> Router:
    torch.manual_seed(seed)
    return Router(D_MODEL, RouterConfig(kind=kind, num_experts=num_experts, top_k=top_k, **kw))


def make_input(num_tokens=32, seed=0) -> torch.Tensor:
    return torch.randn(num_tokens, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("top_k,renormalize,expect_renorm", [
    (1, None, False), (2, None, True), (4, None, True), (2, False, False), (1, True, True)])
def test_topk_router_is_softmax_then_topk_with_renormalisation(top_k, renormalize,
                                                               expect_renorm):
    router = make_router(num_experts=8, top_k=top_k, renormalize=renormalize)
    x = make_input()
    out = router(x)
    probs = torch.softmax(x @ router.weight.t(), dim=-1)
    top, ids = probs.topk(top_k, dim=-1)
    torch.testing.assert_close(out.probs_TE, probs)
    assert torch.equal(out.expert_ids_TK, ids) and out.expert_ids_TK.dtype == torch.int64
    expected = top / top.sum(-1, keepdim=True) if expect_renorm else top
    torch.testing.assert_close(out.scores_TK, expected)


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (64, 2), (16, 4)])
@pytest.mark.parametrize("kind", ["topk", "noisy_topk", "switch", "gshard"])
def test_tied_gates_pick_the_lowest_expert_indices(kind, num_experts, top_k):
    top_k = {"switch": 1, "gshard": 2}.get(kind, top_k)
    router = make_router(kind, num_experts=num_experts, top_k=top_k).eval()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[5, 0] = 1.0  # expert 5 wins for x0 > 0; the rest tie at 0
    x = make_input(6)
    x[:3, 0] = 1.0
    x[3:] = 0.0  # padding tokens: every gate ties
    ids = router(x).expert_ids_TK
    assert ids[:3].tolist() == [[5] + [e for e in range(num_experts) if e != 5][:top_k - 1]] * 3
    assert ids[3:].tolist() == [list(range(top_k))] * 3


def test_lowest_index_top_k_equals_torch_topk_without_ties_and_keeps_gradients():
    values_TE = torch.randn(50, 16, generator=torch.Generator().manual_seed(0),
                            requires_grad=True)
    got_values, got_ids = top_k_lowest_index(values_TE, 3)
    want_values, want_ids = torch.topk(values_TE, 3, dim=-1)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_values, want_values)
    got_values.sum().backward()
    assert values_TE.grad.sum().item() == pytest.approx(150.0)


@pytest.mark.parametrize("kind,top_k", [("noisy_topk", 2), ("switch", 1), ("gshard", 2)])
def test_random_routers_are_deterministic_in_eval_and_draw_noise_in_train(kind, top_k):
    router = make_router(kind, num_experts=8, top_k=top_k, jitter_eps=0.5)
    if kind == "noisy_topk":
        with torch.no_grad():
            router.noise_weight.normal_()
    x = make_input(256)
    router.eval()
    torch.manual_seed(1)
    a = router(x)
    torch.manual_seed(2)
    b = router(x)
    assert torch.equal(a.scores_TK, b.scores_TK) and torch.equal(a.expert_ids_TK,
                                                                 b.expert_ids_TK)
    router.train()
    torch.manual_seed(1)
    c = router(x)
    torch.manual_seed(2)
    d = router(x)
    assert not torch.equal(c.scores_TK, d.scores_TK)
    torch.manual_seed(1)
    assert torch.equal(router(x).scores_TK, c.scores_TK)  # same seed, same draw


def test_noisy_topk_eval_is_softmax_over_the_k_largest_logits_and_noise_weight_learns():
    router = make_router("noisy_topk", num_experts=8, top_k=2)
    x = make_input()
    router.eval()
    out = router(x)
    top, ids = (x @ router.weight.t()).topk(2, dim=-1)
    assert torch.equal(out.expert_ids_TK, ids)
    torch.testing.assert_close(out.scores_TK, torch.softmax(top, dim=-1))
    router.train()
    router(x).scores_TK.square().sum().backward()
    assert router.noise_weight.grad is not None and router.noise_weight.grad.abs().sum() > 0


def test_switch_without_jitter_routes_the_same_in_train_and_eval():
    router = make_router("switch", top_k=1, jitter_eps=0.0)
    x = make_input()
    train_out = router.train()(x)
    eval_out = router.eval()(x)
    assert torch.equal(train_out.scores_TK, eval_out.scores_TK)


def test_gshard_keeps_second_expert_with_probability_min_1_2g2():
    router = make_router("gshard", num_experts=4, top_k=2, seed=3)
    x = make_input(4000, seed=3) * 0.5
    router.eval()
    g2_T = router(x).scores_TK[:, 1]
    router.train()
    torch.manual_seed(0)
    out = router(x)
    kept_T = out.expert_ids_TK[:, 1] >= 0
    expected = torch.clamp(2 * g2_T, max=1.0).mean().item()
    assert 0.05 < expected < 0.95  # the check means something
    assert abs(kept_T.float().mean().item() - expected) < 0.03
    assert torch.all(out.scores_TK[~kept_T, 1] == 0)
    assert torch.all(out.expert_ids_TK[:, 0] >= 0)  # the first expert is never dropped
    no_random = make_router("gshard", num_experts=4, top_k=2, seed=3, random_routing=False)
    assert torch.all(no_random.train()(x).expert_ids_TK >= 0)


@pytest.mark.parametrize("kind,top_k", [("topk", 2), ("noisy_topk", 2), ("switch", 1),
                                        ("gshard", 2)])
def test_router_math_stays_fp32_under_bf16_autocast_and_bf16_weights(kind, top_k):
    router = make_router(kind, top_k=top_k)
    x = make_input()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router.eval()(x)
    reference = router.eval()(x)
    for got, want in zip(out, reference):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert out.scores_TK.dtype == torch.float32 and out.probs_TE.dtype == torch.float32
    router_bf16 = make_router(kind, top_k=top_k).to(torch.bfloat16)
    out_bf16 = router_bf16.eval()(x.to(torch.bfloat16))
    assert out_bf16.scores_TK.dtype == torch.float32 and out_bf16.logits_TE.dtype == torch.float32


@pytest.mark.parametrize("kwargs,expected", [
    (dict(jitter_eps=1.0), "jitter_eps=1.0"), (dict(jitter_eps=-0.1), "jitter_eps=-0.1"),
    (dict(noise_std_min=-1.0), "noise_std_min=-1.0"), (dict(top_k=2.5), "top_k=2.5"),
    (dict(num_experts=2.0), "num_experts=2.0"), (dict(kind="Switch"), "kind='Switch'"),
])
def test_router_config_rejects_bad_values_naming_them(kwargs, expected):
    with pytest.raises(ValueError) as info:
        RouterConfig(**{"kind": "topk", "num_experts": 4, "top_k": 2, **kwargs})
    assert expected in str(info.value)


@pytest.mark.parametrize("capacity_factor,num_tokens,top_k,num_experts,expected", [
    (1.1, 50, 1, 1, 55), (1.1, 25, 2, 1, 55), (1.2, 20, 2, 8, 6), (1.25, 64, 2, 4, 40),
    (1.0, 4096, 2, 8, 1024), (0.5, 33, 2, 4, 9), (2.0, 1, 1, 64, 1), (1.0, 0, 2, 4, 0),
    (0.01, 10, 1, 1, 1)])
def test_expert_capacity_is_the_exact_ceiling(capacity_factor, num_tokens, top_k, num_experts,
                                               expected):
    assert expert_capacity(capacity_factor, num_tokens, top_k, num_experts) == expected
    assert expert_capacity(None, num_tokens, top_k, num_experts) is None


# --- losses ---------------------------------------------------------------------------------

@pytest.mark.parametrize("router,num_experts,top_k", [
    (r, e, {"switch": 1, "gshard": 2}.get(r, k))
    for r in ("topk", "noisy_topk", "switch", "gshard")
    for e, k in ((1, 1), (4, 2), (16, 4)) if not (r == "gshard" and e == 1)])
def test_balance_loss_is_exactly_one_for_a_uniform_router(router, num_experts, top_k):
    torch.manual_seed(0)
    moe = MoE(D_MODEL, num_experts, top_k, d_ff=8, router=router, aux_loss_coef=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe.eval()(make_input(40))
    assert moe.last_stats.balance_loss.item() == pytest.approx(1.0, abs=1e-6)
    assert moe.last_aux_loss.item() == pytest.approx(0.5, abs=1e-6)


def test_balance_loss_is_num_experts_when_one_expert_takes_everything():
    probs_TE = torch.zeros(10, 8)
    probs_TE[:, 3] = 1.0
    ids_TK = torch.full((10, 1), 3)
    assert balance_loss(probs_TE, ids_TK).item() == pytest.approx(8.0)


def test_balance_loss_matches_its_formula_and_ignores_router_dropped_slots():
    gen = torch.Generator().manual_seed(0)
    probs_TE = torch.softmax(torch.randn(12, 4, generator=gen), -1)
    ids_TK = torch.randint(0, 4, (12, 2), generator=gen)
    ids_TK[::3, 1] = -1  # slots the router dropped count for nobody
    valid = ids_TK[ids_TK >= 0]
    f_E = torch.bincount(valid, minlength=4).float() / valid.numel()
    expected = 4 * (f_E * probs_TE.mean(0)).sum()
    torch.testing.assert_close(balance_loss(probs_TE, ids_TK), expected)


def test_balance_loss_reduced_over_a_group_equals_the_loss_of_the_joined_batch():
    gen = torch.Generator().manual_seed(1)
    probs_a, probs_b = (torch.softmax(torch.randn(n, 4, generator=gen), -1) for n in (10, 6))
    ids_a, ids_b = torch.randint(0, 4, (10, 2), generator=gen), torch.randint(0, 4, (6, 2),
                                                                              generator=gen)
    seen = []

    def stats_of_b(stats):  # what an all-reduce over two ranks would return to rank a
        seen.append(stats.shape)
        capture = []
        balance_loss(probs_b, ids_b, lambda s: capture.append(s) or s)
        return stats + capture[0]
    joined = balance_loss(torch.cat([probs_a, probs_b]), torch.cat([ids_a, ids_b]))
    torch.testing.assert_close(balance_loss(probs_a, ids_a, stats_of_b), joined)
    assert len(seen) == 1  # one reduction of one flat tensor per call


def test_z_loss_is_mean_squared_logsumexp_and_zero_for_no_tokens():
    logits_TE = torch.randn(9, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(z_loss(logits_TE), torch.logsumexp(logits_TE, -1).pow(2).mean())
    empty = torch.zeros(0, 4, requires_grad=True)
    loss = z_loss(empty)
    assert loss.item() == 0.0
    loss.backward()
