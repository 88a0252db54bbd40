"""The experts' kept gradient storage (moescale.layers.grad_buffers) is reused only when free.

Reuse is checked by data pointer across steps whose gradients are dropped (`zero_grad()`'s
default); safety by holding a gradient across the next backward (it must keep its values and
the new gradient must live elsewhere); accumulation (no zero_grad) against fresh-buffer
gradients; every step's gradients against a layer without the pool; copies and pickles of a
layer start with an empty pool.

Legend: T tokens, D model width.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from moescale.layers import grad_buffers
from moescale.layers.grad_buffers import GradBuffers
from moescale.layers.moe import MoE

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

needs_use_count = pytest.mark.skipif(grad_buffers._STORAGE_USE_COUNT is None,
                                     reason="this torch exposes no storage use count")


def _layers(glu: bool, bias: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    moe = MoE(16, 4, 2, d_ff=32, glu=glu, bias=bias).to(dtype)
    fresh = copy.deepcopy(moe)
    fresh.experts.grad_buffers = None          # every backward allocates, as before the pool
    return moe, fresh


def _step(moe, x_TD, g_TD):
    (moe(x_TD) * g_TD).sum().backward()


def _inputs(step: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(24, 16, generator=gen).to(dtype),
            torch.randn(24, 16, generator=gen).to(dtype))


def _step_both(moe, fresh, step: int, dtype=torch.float32) -> None:
    """One step of the pooled layer and of the fresh-buffer copy on the same inputs."""
    x_TD, g_TD = _inputs(step, dtype)
    _step(moe, x_TD, g_TD)
    _step(fresh, x_TD, g_TD)


def _expert_grads(moe) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in moe.experts.named_parameters()}


@needs_use_count
@pytest.mark.parametrize("glu,bias", [(False, False), (False, True), (True, False)])
def test_dropped_gradients_are_reused_and_exact(glu, bias):
    moe, fresh = _layers(glu, bias)
    pointers = []
    for step in range(3):
        _step_both(moe, fresh, step)
        ours, ref = _expert_grads(moe), _expert_grads(fresh)
        for name in ref:
            torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=0)
            assert ours[name]._base is None and ours[name].is_contiguous()
        pointers.append({n: g.data_ptr() for n, g in ours.items()})
        del ours, ref                          # holding them would (rightly) block reuse
        moe.zero_grad()
        fresh.zero_grad()
    assert pointers[0] == pointers[1] == pointers[2]
    held = moe.experts.grad_buffers.held_bytes()
    assert held == sum(p.numel() * p.element_size() for p in moe.experts.parameters())


@needs_use_count
def test_a_held_gradient_is_never_written_over():
    moe, _ = _layers(glu=True)
    x_TD, g_TD = _inputs(0)
    _step(moe, x_TD, g_TD)
    kept = _expert_grads(moe)
    values = {n: g.clone() for n, g in kept.items()}
    moe.zero_grad()                            # .grad is None, but `kept` still holds them
    x_TD, g_TD = _inputs(1)
    _step(moe, x_TD, g_TD)
    for name, g in _expert_grads(moe).items():
        assert g.data_ptr() != kept[name].data_ptr()
        torch.testing.assert_close(kept[name], values[name], rtol=0, atol=0)
        assert not torch.equal(g, values[name])


@needs_use_count
def test_accumulation_without_zero_grad_matches_fresh_buffers():
    moe, fresh = _layers(glu=False, bias=True)
    for step in range(3):
        _step_both(moe, fresh, step)
    ours, ref = _expert_grads(moe), _expert_grads(fresh)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-6, atol=1e-6)
    # the .grad tensors plus one storage each to accumulate from: at most two per weight
    assert moe.experts.grad_buffers.held_bytes() <= 2 * sum(
        p.numel() * p.element_size() for p in moe.experts.parameters())


@needs_use_count
def test_bf16_layer_reuses_too():
    moe, fresh = _layers(glu=True, dtype=torch.bfloat16)
    pointers = []
    for step in range(3):
        _step_both(moe, fresh, step, torch.bfloat16)
        for name, g in _expert_grads(fresh).items():
            torch.testing.assert_close(_expert_grads(moe)[name], g, rtol=0, atol=0)
        del g
        pointers.append(moe.experts.w1_EDF.grad.data_ptr())
        moe.zero_grad()
        fresh.zero_grad()
    assert pointers[0] == pointers[1] == pointers[2]


def test_release_copies_and_pickles_start_empty():
    moe, _ = _layers(glu=False)
    x_TD, g_TD = _inputs(0)
    _step(moe, x_TD, g_TD)
    moe.zero_grad()
    assert copy.deepcopy(moe).experts.grad_buffers.held_bytes() == 0
    clone = pickle.loads(pickle.dumps(moe))
    assert isinstance(clone.experts.grad_buffers, GradBuffers)
    assert clone.experts.grad_buffers.held_bytes() == 0
    moe.experts.release_grad_buffers()
    assert moe.experts.grad_buffers.held_bytes() == 0
    _step(moe, x_TD, g_TD)                      # and it fills again
    assert moe.experts.w1_EDF.grad is not None


@needs_use_count
def test_take_reuses_a_dropped_storage_and_forgets_other_sizes():
    pool = GradBuffers()
    like = torch.zeros(3, 4, 5, dtype=torch.bfloat16)
    t = pool.take("w", like)
    assert t.shape == like.shape and t.dtype == like.dtype and t.is_contiguous()
    first = t.data_ptr()
    del t
    again = pool.take("w", like)                # nothing holds the first one: reused
    assert again.data_ptr() == first
    del again
    other = pool.take("w", torch.zeros(2, 2))   # another size under the same name: fresh,
    assert other.shape == (2, 2)                # and the old size's storage is let go
    assert pool.held_bytes() == 2 * 2 * 4
