"""The MoE comparison helpers the `moe_helpers` fixture (tests/conftest.py) hands to tests: run a
layer and its reference oracle on the same input, compare.

Every test file compares fast paths against `moescale.layers.reference.ReferenceMoE` the same
way: outputs, every gradient (input, router weights, every expert weight) and the aux loss, with a
tolerance relative to the scale of the reference value. Plain functions and small dataclasses,
no state between tests, nothing of the code under test mocked. A module of its own so that
conftest.py imports no torch: pytest-xdist's controller process, which runs no test, loads
conftest.py before it starts the workers.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moescale.layers.reference import ReferenceMoE

# Tolerances relative to the reference's scale (max |value|).
FP32_RTOL = 1e-5
BF16_RTOL = 4e-2


@dataclass
class Run:
    """One forward + backward: the output, named gradients and the aux loss."""

    y: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    aux_loss: torch.Tensor


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                        what: str = "value") -> None:
    """max |actual - expected| <= rtol * max(max |expected|, 1e-6), compared in fp32."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    actual, expected = actual.detach().float(), expected.detach().float()
    if expected.numel() == 0:
        return
    scale = max(expected.abs().max().item(), 1e-6)
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3g} > {rtol:g} * scale {scale:.3g}"


def forward_backward(layer: nn.Module, params: dict[str, nn.Parameter], x: torch.Tensor,
                     grad_out: torch.Tensor, seed: int, *, autocast_dtype=None) -> Run:
    """Seed torch, run `layer(x)`, backpropagate <y, grad_out> + aux loss to x and params.

    `layer` is an MoE or its ReferenceMoE (both expose `last_aux_loss` after a call).
    """
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        y = layer(x)
    aux = layer.last_aux_loss
    loss = (y.float() * grad_out.float()).sum() + aux.float()
    names = list(params)
    grads = torch.autograd.grad(loss, [x] + [params[n] for n in names], allow_unused=True)
    return Run(y=y.detach(), grads=dict(zip(["input"] + names, grads)), aux_loss=aux.detach())


def compare_runs(fast: Run, ref: Run, rtol: float) -> None:
    """Outputs, aux loss and every gradient agree; a gradient is None in both or in neither."""
    assert_scaled_close(fast.y, ref.y, rtol, "output")
    assert_scaled_close(fast.aux_loss, ref.aux_loss, rtol, "aux loss")
    assert fast.grads.keys() == ref.grads.keys()
    for name, g_ref in ref.grads.items():
        g_fast = fast.grads[name]
        if g_ref is None or g_fast is None:
            # A parameter the loss does not reach (e.g. noisy_topk's noise weight in eval).
            assert g_ref is None and g_fast is None or \
                (g_ref if g_ref is not None else g_fast).abs().max() == 0, \
                f"grad of {name}: fast {g_fast is not None}, reference {g_ref is not None}"
            continue
        assert_scaled_close(g_fast, g_ref, rtol, f"grad of {name}")


def check_against_reference(moe: nn.Module, x: torch.Tensor, *, seed: int = 1234,
                            rtol: float = FP32_RTOL, autocast_dtype=None,
                            ref_moe: nn.Module | None = None) -> tuple[Run, Run, ReferenceMoE]:
    """Run `moe` and `ReferenceMoE(ref_moe or moe)` on x with the same seed and compare all.

    `ref_moe` is an fp32 twin of a low-precision `moe` (same parameter names); the reference
    always runs in fp32 without autocast. Returns (fast run, reference run, the reference).
    """
    ref_moe = moe if ref_moe is None else ref_moe
    ref = ReferenceMoE(ref_moe)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(x.shape, generator=gen)
    fast = forward_backward(moe, dict(moe.named_parameters()), x, grad_out, seed,
                            autocast_dtype=autocast_dtype)
    reference = forward_backward(ref, dict(ref_moe.named_parameters()), x.float(), grad_out,
                                 seed)
    compare_runs(fast, reference, rtol)
    return fast, reference, ref


def fp32_twin(moe: nn.Module, build) -> nn.Module:
    """`build()` makes a layer of the same architecture; load moe's values into it in fp32."""
    twin = build()
    twin.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    twin.train(moe.training)
    return twin


def force_routing(moe: nn.Module, x_TD: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """Make every token pick `experts` (in that order) by setting the router weights.

    Returns an input whose feature 0 is a constant 1.0; the router weight row of the i-th
    forced expert reads only that feature with a decreasing large value, all other rows are 0.
    """
    x_TD = x_TD.clone()
    x_TD[..., 0] = 1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        for rank, e in enumerate(experts):
            moe.router.weight[e, 0] = 8.0 - rank
    return x_TD


class Helpers:
    """Namespace handed to tests by the `moe_helpers` fixture."""

    FP32_RTOL = FP32_RTOL
    BF16_RTOL = BF16_RTOL
    Run = Run
    assert_scaled_close = staticmethod(assert_scaled_close)
    forward_backward = staticmethod(forward_backward)
    compare_runs = staticmethod(compare_runs)
    check_against_reference = staticmethod(check_against_reference)
    fp32_twin = staticmethod(fp32_twin)
    force_routing = staticmethod(force_routing)
