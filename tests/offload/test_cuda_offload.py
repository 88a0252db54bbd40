"""Offloading on a real CUDA device (skipped without one): CudaDevice copies on its side
stream, and offloaded experts on the GPU against the resident layer (output, input, router and
expert gradients), the device ledger within its budget, and a short training run with the
same losses as all-resident AdamW, for bf16 compute too."""

import copy

import pytest
import torch

from moescale import MoE
from moescale.devices import CudaDevice
from moescale.offload import OffloadConfig, offload_moe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_device_round_trip_on_the_side_stream():
    dev = CudaDevice(1 << 20)
    host = torch.arange(1000, dtype=torch.float32).pin_memory()
    (up,) = dev.upload([host], torch.bfloat16).wait()
    assert up.is_cuda and up.dtype == torch.bfloat16
    (back,) = dev.download([up.float() * 2]).wait()
    assert not back.is_cuda and torch.equal(back, host.bfloat16().float() * 2)


@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
def test_offloaded_layer_matches_resident_on_gpu(policy):
    torch.manual_seed(0)
    moe = MoE(64, 8, 2, d_ff=128, device="cuda")
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device="cuda", device_budget_experts=3,
                                            step_mode="deferred", activation_policy=policy))
    x = torch.randn(256, 64, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = moe(xa), off(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g), yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(off.router.weight.grad, moe.router.weight.grad,
                               rtol=1e-4, atol=1e-5)
    engine.synchronize()
    for e in range(8):
        rec = engine.store.acquire((0, e))
        grads = engine.store.layouts[0].split(rec.grad_P)
        torch.testing.assert_close(grads["w1_EDF"], moe.experts.w1_EDF.grad[e].cpu(),
                                   rtol=1e-4, atol=1e-5)
        engine.store.release((0, e))
    assert engine.device.peak_bytes <= engine.device.budget_bytes
    engine.close()


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_training_matches_resident_on_gpu(mode):
    torch.manual_seed(0)
    base = torch.nn.Sequential(MoE(64, 8, 2, d_ff=128), MoE(64, 8, 2, d_ff=128)).cuda()

    def run(offload):
        model = copy.deepcopy(base)
        engine = offload_moe(model, OffloadConfig(device="cuda", device_budget_experts=3,
                                                  step_mode=mode)) if offload else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if engine:
            engine.follow(opt)
        losses = []
        for step in range(10):
            gen = torch.Generator(device="cuda").manual_seed(step)
            x = torch.randn(128, 64, device="cuda", generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            if engine:
                engine.step()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if engine:
            engine.close()
        return losses

    want, got = run(False), run(True)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b)
