"""Per-expert fences (a forward waits for the running step of the experts it reads), look-ahead
uploads issued while an earlier expert computes, eager steps overlapping backward, and bf16
compute with fp32 masters against the resident layer under autocast."""

import copy
import threading
import time

import torch

from moescale import MoE
from moescale.offload import OffloadConfig, offload_moe


def build():
    torch.manual_seed(0)
    return MoE(12, 4, 2, d_ff=20)


def test_forward_waits_for_a_running_expert_step():
    off = copy.deepcopy(build())
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred"))
    opt = torch.optim.AdamW(off.parameters(), lr=0.1)
    engine.follow(opt)
    x = torch.randn(16, 12)
    off(x).square().sum().backward()
    engine.synchronize()
    gate = threading.Event()
    engine.optimizer._workers[0].submit(gate.wait, 10)  # hold the worker: steps queue behind it
    engine.step()  # returns at once; every expert's step is pending
    opt.step()
    assert all(not engine.optimizer.step_fence(k).done() for k in engine.store.keys())
    threading.Timer(0.3, gate.set).start()
    start = time.perf_counter()
    with torch.no_grad():
        y_fenced = off(x)
    assert time.perf_counter() - start >= 0.25  # it waited for the steps
    engine.synchronize()
    with torch.no_grad():
        y_after = off(x)
    torch.testing.assert_close(y_fenced, y_after, rtol=0, atol=0)
    engine.close()


def test_lookahead_uploads_are_issued_during_compute():
    off = copy.deepcopy(build())
    engine = offload_moe(off, OffloadConfig(device_budget_experts=3, step_mode="deferred"))
    off(torch.randn(32, 12)).sum().backward()
    assert engine.cache.num_lookahead >= 4  # forward: 3 of 4 experts, backward: some
    assert engine.device.copy_thread_names == {"moescale-copy_0"}
    engine.close()


def test_eager_steps_run_on_the_worker_during_backward():
    off = copy.deepcopy(build())
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="eager"))
    off(torch.randn(16, 12)).sum().backward()
    # every expert with tokens already has a step queued, before engine.step() is called
    stepped = [k for k in engine.store.keys() if engine.optimizer.step_fence(k) is not None]
    assert len(stepped) >= 2
    engine.step()
    engine.synchronize()
    assert all(engine.store.versions[k] == 1 for k in engine.store.keys())
    engine.close()


def test_bf16_compute_with_fp32_masters_matches_resident_autocast():
    moe = build()
    off = copy.deepcopy(moe)
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred",
                                            compute_dtype="bfloat16"))
    x = torch.randn(24, 12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = moe(xa), off(xb)
    assert yb.dtype == torch.bfloat16
    bf16 = dict(rtol=2e-2, atol=2e-3)  # rounding order may differ from the grouped kernels
    torch.testing.assert_close(yb.float(), ya.float(), **bf16)
    ya.float().sum().backward(), yb.float().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, **bf16)
    engine.synchronize()
    for e in range(4):
        rec = engine.store.acquire((0, e))
        grads = engine.store.layouts[0].split(rec.grad_P)
        assert grads["w1_EDF"].dtype == torch.float32
        torch.testing.assert_close(grads["w1_EDF"], moe.experts.w1_EDF.grad[e], **bf16)
        torch.testing.assert_close(grads["w2_EFD"], moe.experts.w2_EFD.grad[e], **bf16)
        engine.store.release((0, e))
    engine.close()


def test_zero_grad_discards_expert_gradients():
    off = copy.deepcopy(build())
    engine = offload_moe(off, OffloadConfig(device_budget_experts=2, step_mode="deferred"))
    off(torch.randn(16, 12)).sum().backward()
    engine.synchronize()
    assert engine.optimizer.grad_norm_sq() > 0
    engine.zero_grad()
    assert engine.optimizer.grad_norm_sq() == 0
    engine.close()
