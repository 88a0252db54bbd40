"""The hand-written backward of the grouped expert kernels passes float64 gradcheck.

An independent check of `GroupedFFNRows` and `GroupedFFNRouted` (fused gather, experts,
score weighting and combine) by finite differences, for FFN / GLU, with and without biases,
with named and custom activations and an expert that gets no row. The layer-level parity with
the reference (tests/layers/test_moe_reference_parity.py) covers fp32/bf16 at full size.

Legend: R rows, T tokens, D model width, F hidden width, E experts.
"""

from __future__ import annotations

import pytest
import torch

from moescale.layers.activations import Activation
from moescale.layers.grouped_ffn_autograd import GroupedFFNRouted, GroupedFFNRows

E, D, F = 3, 4, 5
COUNTS = (2, 0, 3)  # expert 1 gets no row
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def weights(glu: bool, bias: bool):
    gen = torch.Generator().manual_seed(0)

    def param(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    return (param(E, D, F), param(E, F, D), param(E, D, F) if glu else None,
            param(E, F) if bias else None, param(E, D) if bias else None)


VARIANTS = [pytest.param(act, glu, bias, id=f"{name}-{'glu' if glu else 'ffn'}"
                         f"{'-bias' if bias else ''}")
            for name, act in (("gelu", "gelu"), ("silu", "silu"), ("gelu_tanh", "gelu_tanh"),
                              ("callable_tanh", torch.tanh))
            for glu, bias in ((False, False), (False, True), (True, False))]


@pytest.mark.parametrize("activation,glu,bias", VARIANTS)
def test_grouped_rows_backward_passes_gradcheck(activation, glu, bias):
    act = Activation(activation)
    w = weights(glu, bias)
    x_RD = torch.randn(sum(COUNTS), D, dtype=torch.float64, requires_grad=True)
    present = [t for t in w if t is not None]

    def f(x_RD, *params):
        it = iter(params)
        full = [next(it) if t is not None else None for t in w]
        return GroupedFFNRows.apply(x_RD, COUNTS, act, None, *full)
    assert torch.autograd.gradcheck(f, (x_RD, *present), fast_mode=True)


@pytest.mark.parametrize("activation,glu,bias", VARIANTS)
def test_grouped_routed_backward_passes_gradcheck_for_input_scores_and_weights(activation, glu,
                                                                              bias):
    act = Activation(activation)
    w = weights(glu, bias)
    gen = torch.Generator().manual_seed(1)
    x_TD = torch.randn(4, D, generator=gen, dtype=torch.float64).requires_grad_(True)
    token_idx_R = torch.tensor([0, 3, 1, 2, 0])  # token 0 has two rows
    scores_R = torch.rand(5, generator=gen, dtype=torch.float64).requires_grad_(True)
    present = [t for t in w if t is not None]

    def f(x_TD, scores_R, *params):
        it = iter(params)
        full = [next(it) if t is not None else None for t in w]
        return GroupedFFNRouted.apply(x_TD, scores_R, token_idx_R, COUNTS, act, None, *full)
    assert torch.autograd.gradcheck(f, (x_TD, scores_R, *present), fast_mode=True)
