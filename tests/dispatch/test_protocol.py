"""The expert Protocol (moescale.dispatch.protocol) on CPU, no process group: a container that is
not one is refused with the fix named, and `AutogradChunkRunner` (how the pipelined exchange
runs any container chunk by chunk) equals forward_rows under autograd on the same chunks:
outputs, input and score gradients, and weight gradients times grad_scale, whether a chunk's
graph is kept or re-run in backward, for parameters and for plain tensors named by
GRAD_TENSORS. A tensor requiring grad that forward_rows reads but the runner would not
differentiate is refused in one line, in forward or backward, never trained without gradient.

Legend: N rows of one chunk in expert order, D model width, L experts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch.nn.functional as F

from moescale.dispatch.protocol import (CAPABILITIES, GRAD_TENSORS, AutogradChunkRunner,
                                        ExpertContainer, capabilities_of)
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


class PlainExperts(nn.Module):
    """_experts(seed)'s values as plain leaf tensors (not parameters), declaring `capabilities`;
    `grad_tensors()` returns all of them but the first `hide`."""

    def __init__(self, seed: int, capabilities=frozenset({GRAD_TENSORS}), hide: int = 0) -> None:
        super().__init__()
        self.num_experts, self.capabilities, self.hide = 3, capabilities, hide
        self.tensors = [[p.detach().clone().requires_grad_(True) for p in m.parameters()]
                        for m in _experts(seed).experts]

    @property
    def expert_ids(self) -> range:
        return range(3)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [t for ts in self.tensors for t in ts][self.hide:]

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.tensors[e]
        return F.linear(F.gelu(F.linear(x_ND, w1, b1)), w2, b2)

    def forward_rows(self, x_RD: torch.Tensor, counts_E) -> torch.Tensor:
        parts = list(x_RD.split(list(counts_E)))
        return torch.cat([self.expert_forward(e, x) for e, x in enumerate(parts)])


def _grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient; zeros when nothing reached it (a chunk without rows)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


@pytest.mark.parametrize("kind", ["parameters", "plain tensors"])
@pytest.mark.parametrize("keep", [True, False])
def test_autograd_chunk_runner_equals_forward_rows_per_chunk(keep, kind):
    chunk_counts = [[2, 0, 3], [0, 0, 0], [1, 4, 2]]
    grad_scale = 0.25
    gen = torch.Generator().manual_seed(1)
    x_k = [torch.randn(sum(c), D, generator=gen) for c in chunk_counts]
    g_k = [torch.randn(sum(c), D, generator=gen) for c in chunk_counts]
    s_k = [torch.rand(sum(c), generator=gen) for c in chunk_counts]

    make, weights = (_experts, lambda c: list(c.parameters())) if kind == "parameters" else \
        (PlainExperts, lambda c: c.grad_tensors())
    ref = make(0)
    x_ref = [x.clone().requires_grad_(True) for x in x_k]
    s_ref = [s.clone().requires_grad_(True) for s in s_k]
    y_ref = [ref.forward_rows(x, c) for x, c in zip(x_ref, chunk_counts)]
    loss = sum((s.unsqueeze(1) * y * g).sum() for s, y, g in zip(s_ref, y_ref, g_k))
    loss.backward()

    experts = make(0)
    runner = AutogradChunkRunner(experts, chunk_counts, grad_scale, x_k[0])
    params = runner.autograd_inputs()
    assert len(params) == len(weights(experts)) == 12
    for k, x in enumerate(x_k):
        y = runner.forward(k, x, keep)
        assert not y.requires_grad
        torch.testing.assert_close(y, y_ref[k].detach())
    for k, (x, g, s) in enumerate(zip(x_k, g_k, s_k)):
        dx, ds = runner.backward(k, None if keep else x, g, s, True, True)
        torch.testing.assert_close(dx, _grad(x_ref[k]))
        torch.testing.assert_close(ds, _grad(s_ref[k]))
    grads = runner.input_grads([True] * len(params))
    for got, p in zip(grads, weights(ref)):
        torch.testing.assert_close(got, grad_scale * p.grad)
    assert runner.input_grads([False] * len(params)) == [None] * len(params)


def _refused(experts, keep: bool, x_grad: bool = True) -> str:
    """The one-line ValueError a chunk runner over `experts` raises for 2 chunks."""
    counts = [[2, 1, 0], [1, 0, 3]]
    x_k = [torch.randn(sum(c), D, requires_grad=x_grad) for c in counts]
    runner = AutogradChunkRunner(experts, counts, 0.5, x_k[0])
    with pytest.raises(ValueError) as err:
        for k, x in enumerate(x_k):
            runner.forward(k, x.detach(), keep)
        for k, x in enumerate(x_k):
            runner.backward(k, None if keep else x.detach(), torch.randn_like(x),
                            torch.rand(x.shape[0]), True, True)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("keep", [True, False])
def test_plain_tensors_the_runner_would_not_differentiate_are_refused(keep):
    """Not named at all (GRAD_TENSORS not declared: parameters() is empty), refused where the
    chunk's graph first exists: forward when kept, backward when re-run."""
    message = _refused(PlainExperts(0, capabilities=frozenset()), keep)
    assert message.startswith("PlainExperts.forward_rows reads 12 tensor(s) requiring grad "
                              "that are not its parameters() (the first: torch.float32 (")
    assert "declare GRAD_TENSORS with grad_tensors() returning every tensor" in message


def test_a_tensor_grad_tensors_leaves_out_is_refused_and_so_is_a_call_without_backward():
    """grad_tensors() missing one tensor; and with no input needing a gradient (the exchange
    would have no backward) the un-kept chunk is checked in forward."""
    message = _refused(PlainExperts(0, hide=1), keep=True)
    assert "reads 1 tensor(s) requiring grad that grad_tensors() does not return (the " \
           "first: torch.float32 (5, 6))" in message
    message = _refused(PlainExperts(0, capabilities=frozenset()), keep=False, x_grad=False)
    assert "that are not its parameters()" in message


def test_a_container_that_is_no_module_must_name_its_tensors():
    class Bare:
        num_experts, capabilities, expert_ids = 1, frozenset(), range(1)

        def forward_rows(self, x_RD, counts_E):
            return x_RD

        def expert_forward(self, e, x_ND):
            return x_ND

    with pytest.raises(ValueError, match="Bare is not an nn.Module, so it has no parameters"):
        AutogradChunkRunner(Bare(), [[1]], 1.0, torch.zeros(1, D))
