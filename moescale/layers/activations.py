"""Expert activations with explicit backward formulas, for the hand-written expert kernels.

The grouped kernels save only the pre-activation hidden and recompute the activation in
backward, so each activation needs its forward and the derivative applied to an upstream
gradient. Known names use aten's fused backward ops; any other callable falls back to a local
autograd call (correct, a little slower).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


class Activation:
    """`forward(h)` and `backward(grad_a, h) -> grad_h` for one elementwise nonlinearity."""

    def __init__(self, spec: str | Callable[[torch.Tensor], torch.Tensor]) -> None:
        if isinstance(spec, str) and spec not in ACTIVATIONS:
            raise ValueError(f"activation={spec!r} is unknown; use one of "
                             f"{', '.join(ACTIVATIONS)} or pass a callable")
        if not isinstance(spec, str) and not callable(spec):
            raise ValueError(f"activation={spec!r} must be a name or a callable")
        self.spec = spec
        self.name = spec if isinstance(spec, str) else getattr(spec, "__name__", "custom")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec == "gelu":
            return F.gelu(h)
        if spec == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
        if spec == "silu":
            return F.silu(h)
        if spec == "relu":
            return F.relu(h)
        return spec(h)

    def forward_into(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = act(h) written into `out` (same dtype as h); returns out."""
        spec = self.spec
        if spec == "gelu":
            return torch.ops.aten.gelu.out(h, out=out)
        if spec == "gelu_tanh":
            return torch.ops.aten.gelu.out(h, approximate="tanh", out=out)
        if spec == "silu":
            return torch.ops.aten.silu.out(h, out=out)
        if spec == "relu":
            return torch.clamp_min(h, 0, out=out)
        return out.copy_(spec(h))

    def backward_into(self, grad_a: torch.Tensor, h: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
        """out = d act(h)/dh * grad_a written into `out` (which may alias grad_a)."""
        spec = self.spec
        if spec == "gelu":
            return torch.ops.aten.gelu_backward.grad_input(grad_a, h, grad_input=out)
        if spec == "gelu_tanh":
            return torch.ops.aten.gelu_backward.grad_input(grad_a, h, approximate="tanh",
                                                           grad_input=out)
        if spec == "silu":
            return torch.ops.aten.silu_backward.grad_input(grad_a, h, grad_input=out)
        if spec == "relu":
            return torch.mul(grad_a, h > 0, out=out)
        return out.copy_(self.backward(grad_a, h))

    def backward(self, grad_a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec == "gelu":
            return torch.ops.aten.gelu_backward(grad_a, h)
        if spec == "gelu_tanh":
            return torch.ops.aten.gelu_backward(grad_a, h, approximate="tanh")
        if spec == "silu":
            return torch.ops.aten.silu_backward(grad_a, h)
        if spec == "relu":
            return grad_a * (h > 0)
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_(True)
            (grad_h,) = torch.autograd.grad(spec(h_leaf), h_leaf, grad_a)
        return grad_h
