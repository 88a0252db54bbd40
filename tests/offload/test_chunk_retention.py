"""A chunked walk keeps the copies it will use again (cache.py, retention; engine.py, snake
order): StreamedChunkRunner driven chunk by chunk as the pipelined exchange drives it, host and
disk tiers, eager and deferred steps, 2 and 4 chunks, with a device budget below the local
experts. Against the same calls with retention and snake order off (every chunk ascending,
every copy freed when the walk moves on, i.e. the path before retention): fewer uploads (as
many as the positions the retained copies served), the simulated device's peak within its
budget, and bitwise the same outputs, input and score gradients, store gradients and stepped
masters. Walks straight on the device cache with a budget of exactly one expert (forward) and
two (an expert plus its gradient, backward) finish, within the budget, with the masters' values.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from moescale import MoE
from moescale.devices import SimulatedDevice
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.cache import DeviceCache

D, F = 12, 20


def _counts(chunks: int, experts: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = torch.randint(1, 6, (chunks, experts), generator=gen)
    out[chunks - 1, 1] = 0        # an expert without rows in one chunk (a gap in the snake)
    return out.tolist()


def _run(off, engine, chunk_counts, seed: int, last: bool) -> list[torch.Tensor]:
    """One pipelined-style call of the offloaded container: forward k = 0..C-1, then backward
    k = 0..C-1; its outputs, input gradients and score gradients."""
    gen = torch.Generator().manual_seed(seed)
    rows = [sum(c) for c in chunk_counts]
    xs = [torch.randn(n, D, generator=gen) for n in rows]
    gs = [torch.randn(n, D, generator=gen) for n in rows]
    ss = [torch.rand(n, generator=gen) for n in rows]
    engine.begin_micro_batch(last=last)
    runner = off.experts.chunk_runner(chunk_counts, 0.5, xs[0])
    ys = [runner.forward(k, xs[k], keep=True) for k in range(len(rows))]
    back = [runner.backward(k, xs[k], gs[k], ss[k], True, True) for k in range(len(rows))]
    runner.input_grads([True, True])
    return ys + [t for pair in back for t in pair]


def _train(tier, step_mode, chunks, retain, tmp_path, budget=3, pin=0.0, experts=4):
    torch.manual_seed(0)
    moe = MoE(D, experts, 2, d_ff=F, glu=True)
    off = copy.deepcopy(moe)
    directory = None
    if tier == "disk":
        directory = tmp_path / f"store-{retain}"
        directory.mkdir()
    engine = offload_moe(off, OffloadConfig(
        tier=tier, device_budget_experts=budget, step_mode=step_mode, pin_fraction=pin,
        directory=None if directory is None else str(directory),
        host_cache_bytes=1 << 20 if tier == "disk" else None, device="cpu"))
    engine.cache.retain = engine.snake = retain
    got, calls = [], 0
    try:
        for step in range(2):
            for micro in range(2):
                counts = _counts(chunks, experts, seed=10 * step + micro)
                got += _run(off, engine, counts, seed=100 + 10 * step + micro, last=micro == 1)
                calls += 1
                if micro == 0:
                    engine.synchronize()
                    got += [off.experts.master(e) for e in range(experts)]
                    for e in range(experts):
                        rec = engine.store.acquire((0, e))
                        got.append(rec.grad_P.clone())
                        engine.store.release((0, e))
            engine.step()
            engine.synchronize()
            got += [off.experts.master(e) for e in range(experts)]
        stats = dict(uploads=engine.cache.num_uploads, reused=engine.cache.num_reused,
                     peak=engine.device.peak_bytes, budget=engine.device.budget_bytes,
                     calls=calls)
    finally:
        engine.close()
    return got, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("step_mode", ["eager", "deferred"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_retention_uploads_less_and_changes_no_number(tier, step_mode, chunks, tmp_path):
    want, before = _train(tier, step_mode, chunks, False, tmp_path)
    got, after = _train(tier, step_mode, chunks, True, tmp_path)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert after["reused"] > 0 and before["reused"] == 0
    assert after["uploads"] + after["reused"] == before["uploads"]   # same positions served
    assert after["uploads"] < before["uploads"]
    for s in (before, after):
        assert 0 < s["peak"] <= s["budget"]


@pytest.mark.timeout(120)
def test_retention_with_pinned_experts(tmp_path):
    want, before = _train("host", "eager", 4, False, tmp_path, budget=5, pin=0.34, experts=6)
    got, after = _train("host", "eager", 4, True, tmp_path, budget=5, pin=0.34, experts=6)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert after["uploads"] < before["uploads"] and after["peak"] <= after["budget"]


def _cache(budget_experts: int, lookahead: int):
    torch.manual_seed(0)
    moe = MoE(D, 4, 2, d_ff=F)
    engine = offload_moe(moe, OffloadConfig(tier="host", device_budget_experts=2,
                                            device="cpu"))
    nbytes = engine.cache.expert_bytes(0)
    device = SimulatedDevice(budget_experts * nbytes)
    cache = DeviceCache(device, engine.store, engine.optimizer, engine.dtype,
                        lookahead=lookahead)
    return engine, cache, device, nbytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("budget,headroom", [(1, False), (2, True), (2, False), (3, True)])
def test_walk_with_a_budget_of_one_or_two_experts_finishes(budget, headroom, lookahead):
    engine, cache, device, nbytes = _cache(budget, lookahead)
    order = [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3]
    seen = []
    try:
        for e, w_P in cache.walk(0, order, headroom=nbytes if headroom else 0):
            seen.append(e)
            assert torch.equal(w_P, engine.layers[0].master(e).to(engine.dtype))
            if headroom:    # the gradient, released by another thread as the optimizer does
                grad = device.reserve(nbytes, "gradient", block=True, async_release=True)
                threading.Timer(0.005, grad.release).start()
        assert seen == order
        assert cache.num_uploads + cache.num_reused == len(order)
        assert cache.num_reused >= 2          # at least the two chunk boundaries
        assert device.peak_bytes <= device.budget_bytes
        device.synchronize()
        deadline = threading.Event()
        while device.used_bytes and not deadline.wait(0.01):
            pass                               # the last gradient's timer
        assert device.used_bytes == 0          # every retained copy released at the end
    finally:
        device.close()
        engine.close()


def test_walk_closed_early_releases_retained_copies():
    engine, cache, device, nbytes = _cache(3, 1)
    walk = cache.walk(0, [0, 1, 2, 2, 1, 0])
    for _ in range(4):
        next(walk)
    assert device.used_bytes > nbytes
    walk.close()
    assert device.used_bytes == 0
    device.close()
    engine.close()


def test_a_retained_copy_whose_master_stepped_is_uploaded_again():
    engine, cache, device, nbytes = _cache(3, 1)
    layout = engine.store.layouts[0]
    before = engine.layers[0].master(0)
    try:
        for i, (e, w_P) in enumerate(cache.walk(0, [0, 1, 0])):
            if i == 0:     # expert 0 steps (eager) while its copy is retained
                grads = list(layout.split(torch.ones(layout.numel)).values())
                engine.optimizer.accumulate((0, 0), grads, last=True)
            if i == 2:
                after = engine.layers[0].master(0)
                assert not torch.equal(after, before)
                assert torch.equal(w_P, after.to(engine.dtype))
        assert cache.num_reused == 0 and cache.num_uploads == 3
    finally:
        device.close()
        engine.close()
