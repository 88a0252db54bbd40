"""OffloadedExperts against the reference: output, input gradient, router gradient and every
expert weight gradient (read from the store's fp32 accumulators), for the keep / recompute /
offload activation policies, plain / GLU / bias experts, routed and rows entry points; experts
without tokens are never uploaded; a budget below one expert fails at once."""

import copy

import pytest
import torch

from moescale import MoE, ReferenceMoE
from moescale.devices import DeviceBudgetError
from moescale.offload import OffloadConfig, offload_moe

NAMES = ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED")


def build(glu=False, bias=False, num_experts=6, top_k=2):
    torch.manual_seed(0)
    return MoE(12, num_experts, top_k, d_ff=20, glu=glu, bias=bias)


def expert_grads(engine, layer, e):
    engine.synchronize()
    rec = engine.store.acquire((layer, e))
    try:
        return {n: t.clone() for n, t in engine.store.layouts[layer].split(rec.grad_P).items()}
    finally:
        engine.store.release((layer, e))


@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
@pytest.mark.parametrize("glu,bias", [(False, False), (True, False), (False, True)])
def test_output_and_all_gradients_match_reference(policy, glu, bias):
    moe = build(glu, bias)
    ref = ReferenceMoE(copy.deepcopy(moe))
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred",
                                            activation_policy=policy))
    x = torch.randn(2, 9, 12)
    x_ref, x_off = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_off = ref(x_ref), off(x_off)
    torch.testing.assert_close(y_off, y_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().add(ref.last_aux_loss).backward()
    (y_off * g).sum().add(off.last_aux_loss).backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(off.router.weight.grad, ref.moe.router.weight.grad,
                               rtol=1e-5, atol=1e-6)
    for e in range(moe.num_experts):
        got = expert_grads(engine, 0, e)
        for name in NAMES:
            p = getattr(ref.moe.experts, name)
            if p is not None:
                torch.testing.assert_close(got[name], p.grad[e], rtol=1e-5, atol=1e-6)
    assert engine.device.peak_bytes <= engine.device.budget_bytes
    assert list(off.parameters()) == [off.router.weight]  # the experts left the model
    engine.close()


def test_rows_entry_point_matches_grouped_kernel():
    moe = build()
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=3, step_mode="deferred",
                                            activation_policy="recompute"))
    counts = (3, 0, 5, 1, 0, 2)
    x = torch.randn(sum(counts), 12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = moe.experts.forward_rows(xa, counts), off.experts.forward_rows(xb, counts)
    torch.testing.assert_close(yb, ya)
    g = torch.randn_like(ya)
    ya.backward(g), yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad)
    for e in range(6):
        got = expert_grads(engine, 0, e)
        torch.testing.assert_close(got["w1_EDF"], moe.experts.w1_EDF.grad[e])
        torch.testing.assert_close(got["w2_EFD"], moe.experts.w2_EFD.grad[e])
    engine.close()


def test_experts_without_tokens_are_never_uploaded():
    moe = build(num_experts=6, top_k=1)
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred"))
    counts = (4, 0, 0, 2, 0, 0)
    x = torch.randn(6, 12, requires_grad=True)
    off.experts.forward_rows(x, counts).sum().backward()
    assert engine.cache.num_uploads == 4  # experts 0 and 3, forward and backward
    engine.close()


def test_no_grad_forward_needs_no_backward():
    moe = build()
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2))
    x = torch.randn(5, 12)
    with torch.no_grad():
        torch.testing.assert_close(off(x), moe(x))
    assert engine.device.used_bytes == 0
    engine.close()


def test_budget_below_one_expert_fails_at_once():
    one_expert = 4 * (12 * 20 * 2)
    with pytest.raises(ValueError, match="below one expert"):
        offload_moe(build(), OffloadConfig(device_budget_bytes=one_expert - 1))
    with pytest.raises(ValueError, match="below one expert"):
        offload_moe(build(), OffloadConfig(device_budget_experts=0.5))


def test_budget_below_weights_plus_gradient_fails_at_once():
    one_expert = 4 * (12 * 20 * 2)
    with pytest.raises(ValueError, match="plus its gradient"):
        offload_moe(build(), OffloadConfig(device_budget_bytes=one_expert))


def test_blocked_upload_past_budget_raises_clearly():
    moe = build()
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred"))
    squatter = engine.device.reserve(engine.device.budget_bytes - 10, "something else")
    with pytest.raises(DeviceBudgetError, match="exceeds the device budget"):
        off(torch.randn(7, 12))
    squatter.release()
    off(torch.randn(7, 12)).sum().backward()
    engine.close()


def test_config_errors_name_the_argument():
    for kwargs, word in [(dict(activation_policy="drop"), "activation_policy"),
                         (dict(step_mode="lazy"), "step_mode"),
                         (dict(tier="ssd"), "tier"),
                         (dict(compute_dtype="int8"), "compute_dtype"),
                         (dict(lookahead=-1), "lookahead"),
                         (dict(pin_fraction=1.5), "pin_fraction"),
                         (dict(host_cache_bytes=0), "host_cache_bytes")]:
        with pytest.raises(ValueError, match=word):
            OffloadConfig(**kwargs)
    # what needs the call's context is checked by offload_moe before anything moves: the disk
    # tier's directory (a run fills it in from its run directory), and device-only's no-op
    for kwargs, word in [(dict(tier="disk"), "directory"), (dict(tier="device-only"),
                                                            "nothing to offload")]:
        moe = build()
        with pytest.raises(ValueError, match=word):
            offload_moe(moe, OffloadConfig(**kwargs))
        assert type(moe.experts).__name__ == "GroupedExperts"


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(12, 16)
        self.down = torch.nn.Linear(16, 12, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def test_module_experts_match_reference_and_train_like_resident():
    torch.manual_seed(0)
    moe = MoE(12, 4, 2, experts=[TwoLayer() for _ in range(4)])
    ref = ReferenceMoE(copy.deepcopy(moe))
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred"))
    assert [n for n, _ in off.named_parameters()] == ["router.weight"]
    x = torch.randn(15, 12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), off(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ya)
    (ya * g).sum().backward(), (yb * g).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(off.router.weight.grad, ref.moe.router.weight.grad,
                               rtol=1e-5, atol=1e-6)
    for e in range(4):
        got = expert_grads(engine, 0, e)
        for name, p in ref.moe.experts.experts[e].named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(off.experts.expert_forward(e, x),
                                   ref.moe.experts.expert_forward(e, x))
    engine.close()


def test_heterogeneous_module_experts_are_refused():
    experts = [TwoLayer(), torch.nn.Linear(12, 12)]
    with pytest.raises(ValueError, match="same parameters"):
        offload_moe(MoE(12, 2, 1, experts=experts), OffloadConfig())


def test_meta_device_model_with_expert_init():
    torch.manual_seed(0)
    real = MoE(12, 4, 2, d_ff=20)
    meta = MoE(12, 4, 2, d_ff=20, device="meta")
    with pytest.raises(ValueError, match="expert_init"):
        offload_moe(copy.deepcopy(meta), OffloadConfig())

    def init(layer, e, layout):
        return torch.cat([getattr(real.experts, n)[e].reshape(-1) for n in layout.names])
    engine = offload_moe(meta, OffloadConfig(device_budget_experts=2), expert_init=init)
    meta.to_empty(device="cpu")
    meta.router.weight.data.copy_(real.router.weight)
    x = torch.randn(9, 12)
    with torch.no_grad():
        torch.testing.assert_close(meta(x), real(x))
    engine.close()
