"""The expert Protocol (moescale.dispatch.protocol) on CPU, no process group: a container that is
not one is refused with the fix named, and `AutogradChunkRunner` (how the pipelined exchange
runs any container chunk by chunk) equals forward_rows under autograd on the same chunks:
outputs, input and score gradients, and weight gradients times grad_scale, whether a chunk's
graph is kept or re-run in backward.

Legend: N rows of one chunk in expert order, D model width, L experts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moescale.dispatch.protocol import (CAPABILITIES, AutogradChunkRunner, ExpertContainer,
                                        capabilities_of)
from moescale.layers.experts import GroupedExperts, ModuleExperts

D = 6
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_capabilities_of_names_what_a_non_container_lacks():
    with pytest.raises(ValueError, match="Linear is not an expert container: it needs "
                                         "num_experts, expert_ids, capabilities"):
        capabilities_of(nn.Linear(2, 2))
    experts = GroupedExperts(3, D, 8)
    assert isinstance(experts, ExpertContainer)
    assert capabilities_of(experts) == experts.capabilities <= CAPABILITIES


def _experts(seed: int) -> ModuleExperts:
    torch.manual_seed(seed)
    return ModuleExperts([nn.Sequential(nn.Linear(D, 5), nn.GELU(), nn.Linear(5, D))
                          for _ in range(3)])


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient; zeros when nothing reached it (a chunk without rows)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


@pytest.mark.parametrize("keep", [True, False])
def test_autograd_chunk_runner_equals_forward_rows_per_chunk(keep):
    chunk_counts = [[2, 0, 3], [0, 0, 0], [1, 4, 2]]
    grad_scale = 0.25
    gen = torch.Generator().manual_seed(1)
    x_k = [torch.randn(sum(c), D, generator=gen) for c in chunk_counts]
    g_k = [torch.randn(sum(c), D, generator=gen) for c in chunk_counts]
    s_k = [torch.rand(sum(c), generator=gen) for c in chunk_counts]

    ref = _experts(0)
    x_ref = [x.clone().requires_grad_(True) for x in x_k]
    s_ref = [s.clone().requires_grad_(True) for s in s_k]
    y_ref = [ref.forward_rows(x, c) for x, c in zip(x_ref, chunk_counts)]
    loss = sum((s.unsqueeze(1) * y * g).sum() for s, y, g in zip(s_ref, y_ref, g_k))
    loss.backward()

    experts = _experts(0)
    runner = AutogradChunkRunner(experts, chunk_counts, grad_scale, x_k[0])
    params = runner.autograd_inputs()
    assert len(params) == len(list(experts.parameters()))
    for k, x in enumerate(x_k):
        y = runner.forward(k, x, keep)
        assert not y.requires_grad
        torch.testing.assert_close(y, y_ref[k].detach())
    for k, (x, g, s) in enumerate(zip(x_k, g_k, s_k)):
        dx, ds = runner.backward(k, None if keep else x, g, s, True, True)
        torch.testing.assert_close(dx, _grad(x_ref[k]))
        torch.testing.assert_close(ds, _grad(s_ref[k]))
    grads = runner.input_grads([True] * len(params))
    for got, p in zip(grads, ref.parameters()):
        torch.testing.assert_close(got, grad_scale * p.grad)
    assert runner.input_grads([False] * len(params)) == [None] * len(params)
