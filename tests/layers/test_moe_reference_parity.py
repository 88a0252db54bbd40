"""The MoE layer equals the reference oracle: outputs, every gradient and the aux loss.

Covers every router kind (train mode, so noise / jitter / random routing are drawn, and eval
mode), top_k in {1, 2, 4}, num_experts in {1, 4, 16}, dropless and capacity runs that drop
tokens, FFN / GLU / bias / activation variants, custom module experts, a 1-expert MoE versus
the dense FFN, fp32 (tight) and bf16 (loose: autocast, and parameters held in bf16).
Tiny dimensions keep the whole file to a few seconds; speed is measured by benchmarks, not here.

Legend: T tokens, D model width, F expert hidden width, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moescale import MoE, ReferenceMoE

D_MODEL, D_FF = 16, 32
ROUTER_TOPK = [("topk", 1), ("topk", 2), ("topk", 4), ("noisy_topk", 1), ("noisy_topk", 2),
               ("noisy_topk", 4), ("switch", 1), ("gshard", 2)]
NUM_EXPERTS = [1, 4, 16]
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
ROUTING_CASES = [pytest.param(r, k, e, id=f"{r}-k{k}-E{e}") for r, k in ROUTER_TOPK
                 for e in NUM_EXPERTS if k <= e and not (r == "gshard" and e < 2)]
CAPACITIES = [pytest.param(None, id="dropless"), pytest.param(0.5, id="cap0.5"),
              pytest.param(1.0, id="cap1.0")]
MODES = [pytest.param(True, id="train"), pytest.param(False, id="eval")]


def make_input(shape=(2, 16), seed=0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, D_MODEL, generator=gen).to(dtype)


def build(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    kw.setdefault("d_ff", D_FF)
    return MoE(D_MODEL, **kw)


@pytest.mark.parametrize("train", MODES)
@pytest.mark.parametrize("capacity_factor", CAPACITIES)
@pytest.mark.parametrize("router,top_k,num_experts", ROUTING_CASES)
def test_outputs_grads_and_aux_loss_equal_reference_fp32(moe_helpers, router, top_k,
                                                         num_experts, capacity_factor, train):
    moe = build(num_experts=num_experts, top_k=top_k, router=router,
                capacity_factor=capacity_factor, z_loss_coef=1e-2)
    moe.train(train)
    x = make_input()
    fast, ref_run, ref = moe_helpers.check_against_reference(moe, x)
    assert fast.y.shape == x.shape
    # Dropped choices: the plan's count equals the reference's keep mask, and capacity 0.5
    # (half the routing choices fit) really drops.
    assert moe.last_stats.num_dropped == int((~ref.last_keep_TK).sum())
    if capacity_factor == 0.5:
        assert moe.last_stats.num_dropped > 0
    if capacity_factor is None and router != "gshard":
        assert moe.last_stats.num_dropped == 0
    # Every weight the loss reaches got a gradient (router and all expert tensors).
    assert fast.grads["router.weight"] is not None
    for name in ("experts.w1_EDF", "experts.w2_EFD"):
        assert fast.grads[name] is not None


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("glu,bias,activation", [
    pytest.param(False, True, "gelu", id="ffn-bias-gelu"),
    pytest.param(True, False, "silu", id="glu-silu"),
    pytest.param(False, False, "relu", id="ffn-relu"),
    pytest.param(False, True, "gelu_tanh", id="ffn-bias-gelu_tanh"),
    pytest.param(True, False, torch.tanh, id="glu-callable_tanh"),
])
def test_expert_variants_glu_bias_activation_equal_reference(moe_helpers, glu, bias, activation,
                                                             capacity_factor):
    moe = build(num_experts=4, top_k=2, glu=glu, bias=bias, activation=activation,
                capacity_factor=capacity_factor)
    fast, _, _ = moe_helpers.check_against_reference(moe, make_input())
    expected = {"experts.w1_EDF", "experts.w2_EFD"} | ({"experts.w3_EDF"} if glu else set()) \
        | ({"experts.b1_EF", "experts.b2_ED"} if bias else set())
    for name in expected:
        assert fast.grads[name] is not None and fast.grads[name].abs().sum() > 0, name


@pytest.mark.parametrize("train", MODES)
@pytest.mark.parametrize("router,top_k,num_experts", [
    pytest.param("topk", 2, 4, id="topk-k2-E4"), pytest.param("topk", 4, 16, id="topk-k4-E16"),
    pytest.param("noisy_topk", 2, 4, id="noisy_topk-k2-E4"),
    pytest.param("switch", 1, 4, id="switch-k1-E4"), pytest.param("gshard", 2, 16, id="gshard-E16"),
    pytest.param("topk", 1, 1, id="topk-k1-E1")])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_bf16_autocast_fast_path_matches_fp32_reference(moe_helpers, router, top_k, num_experts,
                                                        capacity_factor, train):
    moe = build(num_experts=num_experts, top_k=top_k, router=router, glu=router == "topk",
                capacity_factor=capacity_factor)
    moe.train(train)
    fast, _, _ = moe_helpers.check_against_reference(moe, make_input(),
                                                     autocast_dtype=torch.bfloat16,
                                                     rtol=moe_helpers.BF16_RTOL)
    assert fast.y.dtype == torch.bfloat16
    # Autocast computes in bf16 but the parameters and their gradients stay fp32.
    assert all(g is None or g.dtype == torch.float32 for g in fast.grads.values())


@pytest.mark.parametrize("router,top_k,bias,glu", [
    pytest.param("topk", 2, True, False, id="topk-bias"),
    pytest.param("noisy_topk", 2, False, True, id="noisy_topk-glu"),
    pytest.param("switch", 1, True, False, id="switch-bias"),
    pytest.param("gshard", 2, False, False, id="gshard")])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_model_held_in_bf16_matches_fp32_reference(moe_helpers, router, top_k, bias, glu,
                                                   capacity_factor):
    def make(dtype=None):
        return build(num_experts=4, top_k=top_k, router=router, bias=bias, glu=glu,
                     capacity_factor=capacity_factor, z_loss_coef=1e-2, dtype=dtype)
    moe = make(torch.bfloat16)
    twin = moe_helpers.fp32_twin(moe, make)
    x = make_input(dtype=torch.bfloat16)
    fast, _, _ = moe_helpers.check_against_reference(moe, x, ref_moe=twin,
                                                     rtol=moe_helpers.BF16_RTOL)
    assert fast.y.dtype == torch.bfloat16
    assert fast.grads["experts.w1_EDF"].dtype == torch.bfloat16


@pytest.mark.parametrize("train", MODES)
@pytest.mark.parametrize("router", ["topk", "noisy_topk", "switch"])
def test_one_expert_moe_equals_dense_ffn(router, train):
    moe = build(num_experts=1, top_k=1, router=router, bias=True, activation="gelu")
    moe.train(train)
    dense = nn.Sequential(nn.Linear(D_MODEL, D_FF), nn.GELU(), nn.Linear(D_FF, D_MODEL))
    with torch.no_grad():
        dense[0].weight.copy_(moe.experts.w1_EDF[0].t())
        dense[0].bias.copy_(moe.experts.b1_EF[0])
        dense[2].weight.copy_(moe.experts.w2_EFD[0].t())
        dense[2].bias.copy_(moe.experts.b2_ED[0])
    x = make_input((3, 7))
    grad_out = torch.randn(x.shape)
    x_moe, x_dense = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_moe, y_dense = moe(x_moe), dense(x_dense)
    torch.testing.assert_close(y_moe, y_dense, rtol=1e-5, atol=1e-6)
    (y_moe * grad_out).sum().backward()
    (y_dense * grad_out).sum().backward()
    pairs = [(x_moe.grad, x_dense.grad), (moe.experts.w1_EDF.grad[0], dense[0].weight.grad.t()),
             (moe.experts.b1_EF.grad[0], dense[0].bias.grad),
             (moe.experts.w2_EFD.grad[0], dense[2].weight.grad.t()),
             (moe.experts.b2_ED.grad[0], dense[2].bias.grad)]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # One expert: the score is softmax over one logit, 1 whatever the router weight.
    assert moe.router.weight.grad is None or moe.router.weight.grad.abs().max() == 0


class GLUBlock(nn.Module):
    """A Llama-style gated MLP, as a user-written expert."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def mlp(d_ff: int = D_FF) -> nn.Module:
    return nn.Sequential(nn.Linear(D_MODEL, d_ff), nn.GELU(), nn.Linear(d_ff, D_MODEL))


def heterogeneous_experts() -> list[nn.Module]:
    return [mlp(), GLUBlock(D_MODEL, 24), nn.Linear(D_MODEL, D_MODEL),
            nn.Sequential(nn.LayerNorm(D_MODEL), mlp(8))]


@pytest.mark.parametrize("capacity_factor", CAPACITIES)
@pytest.mark.parametrize("kind", ["factory", "list", "heterogeneous"])
def test_module_experts_equal_reference(moe_helpers, kind, capacity_factor):
    torch.manual_seed(0)
    experts = {"factory": lambda e: mlp(), "list": [mlp() for _ in range(4)],
               "heterogeneous": heterogeneous_experts()}[kind]
    moe = MoE(D_MODEL, 4, 2, experts=experts, capacity_factor=capacity_factor)
    assert type(moe.experts).__name__ == "ModuleExperts" and moe.num_experts == 4
    fast, _, _ = moe_helpers.check_against_reference(moe, make_input((2, 12)))
    expert_grads = [n for n, g in fast.grads.items() if n.startswith("experts.") and g is not None]
    assert len(expert_grads) == len([n for n, _ in moe.named_parameters()
                                     if n.startswith("experts.")])


def test_heterogeneous_module_experts_under_bf16_autocast_match_reference(moe_helpers):
    torch.manual_seed(0)
    moe = MoE(D_MODEL, experts=heterogeneous_experts(), top_k=2)
    assert moe.num_experts == 4  # num_experts defaults to the list's length
    fast, _, _ = moe_helpers.check_against_reference(moe, make_input(), rtol=moe_helpers.BF16_RTOL,
                                                     autocast_dtype=torch.bfloat16)
    assert fast.y.dtype == torch.bfloat16


@pytest.mark.parametrize("trainable", ["router_only", "experts_only", "w2_only", "nothing"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "no_input_grad"])
def test_frozen_parameters_and_input_without_grad_match_reference(moe_helpers, trainable,
                                                                  input_grad):
    moe = build(num_experts=4, top_k=2, bias=True, capacity_factor=1.0)
    for name, p in moe.named_parameters():
        p.requires_grad_({"router_only": name.startswith("router."),
                          "experts_only": name.startswith("experts."),
                          "w2_only": name == "experts.w2_EFD", "nothing": False}[trainable])
    wanted = [p for p in moe.parameters() if p.requires_grad]
    if not wanted and not input_grad:
        return  # nothing to differentiate
    x, grad_out = make_input(), make_input(seed=1)
    results = []
    for layer in (moe, ReferenceMoE(moe)):
        x_in = x.clone().requires_grad_(input_grad)
        y = layer(x_in)
        inputs = ([x_in] if input_grad else []) + wanted
        results.append((y, torch.autograd.grad((y * grad_out).sum(), inputs)))
    (y_fast, g_fast), (y_ref, g_ref) = results
    moe_helpers.assert_scaled_close(y_fast, y_ref, moe_helpers.FP32_RTOL, "output")
    for a, b in zip(g_fast, g_ref):
        moe_helpers.assert_scaled_close(a, b, moe_helpers.FP32_RTOL, "gradient")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("glu,bias", [(False, False), (False, True), (True, False)])
def test_backward_of_a_plain_sum_broadcast_gradient_matches_reference(moe_helpers, glu, bias,
                                                                      autocast):
    # y.sum() hands backward an expanded, stride-0 gradient (torch._grouped_mm's CPU backward
    # raises on exactly that); every path must accept it.
    moe = build(num_experts=4, top_k=2, glu=glu, bias=bias)
    params = dict(moe.named_parameters())
    grads = []
    for layer in (moe, ReferenceMoE(moe)):
        x = make_input().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and layer is moe):
            y = layer(x)
        grads.append(torch.autograd.grad(y.sum(), [x] + list(params.values())))
    rtol = moe_helpers.BF16_RTOL if autocast else moe_helpers.FP32_RTOL
    for name, a, b in zip(["input"] + list(params), *grads):
        moe_helpers.assert_scaled_close(a, b, rtol, f"grad of {name}")
