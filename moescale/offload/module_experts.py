"""Offloaded module experts: any nn.Module experts, run with torch.func.functional_call.

`OffloadedModuleExperts` replaces a `ModuleExperts` container: every expert's parameters are
flattened into the ExpertStore and the modules keep only meta-device placeholders (so the
model's parameters no longer include them). The shared `OffloadedExpertsFn` streams each
expert's flat weights through the device cache and calls:
- `run_expert`: `functional_call(module_e, weights, (x_ND,))` without autograd;
- `run_expert_backward`: the same call under autograd on fresh leaves, then one
  `torch.autograd.grad` for dX, every weight gradient and (routed) the score gradient
  `<gy, y>`. The expert's forward is thus always recomputed in backward: keeping its autograd
  graph would keep its weights alive on the device, which offloading exists to avoid. The
  activation policy therefore has no effect on module experts (documented).

All experts of a layer must have the same parameter names and shapes (the store's layout is
per layer); buffers stay in the modules and are read as they are (no running statistics are
updated through functional_call's parameters).

Deliberately not here: heterogeneous expert lists (not done yet), in-place buffer updates.

Legend: N rows of one expert, D model width, P parameters of one expert.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from moescale.offload.experts import OffloadedExpertsBase
from moescale.offload.store import ExpertLayout


def module_layout(modules) -> ExpertLayout:
    """The common layout of the experts' parameters; ValueError when they differ."""
    specs = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in modules]
    for i, spec in enumerate(specs[1:], start=1):
        if spec != specs[0]:
            raise ValueError(f"offloading module experts needs experts with the same "
                             f"parameters; expert 0 has {specs[0]} but expert {i} has {spec}")
    if not specs[0]:
        raise ValueError("module experts without parameters cannot be offloaded")
    return ExpertLayout(specs[0])


def _to_meta(module: nn.Module) -> None:
    """Replace every parameter by a meta-device placeholder of the same shape."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(torch.empty(p.shape, device="meta"),
                                                     requires_grad=False)


class OffloadedModuleExperts(OffloadedExpertsBase):
    """Stand-in for ModuleExperts whose parameters live in an ExpertStore."""

    def __init__(self, engine, layer_index: int, modules, d_model: int,
                 layout: ExpertLayout) -> None:
        super().__init__(engine, layer_index, len(modules), d_model, layout)
        for m in modules:
            _to_meta(m)
        self._modules_list = list(modules)  # a plain list: not registered, no parameters

    def run_expert(self, e: int, x_ND: torch.Tensor, w_P: torch.Tensor, keep_hidden: bool):
        with torch.no_grad():
            y_ND = functional_call(self._modules_list[e], self.layout.split(w_P), (x_ND,))
        return y_ND, None

    def run_expert_backward(self, e: int, gy_ND, x_ND, w_P, hidden, scale_N, need_dx: bool):
        with torch.enable_grad():
            params = {n: t.detach().requires_grad_() for n, t in self.layout.split(w_P).items()}
            x_in = x_ND.detach().requires_grad_(need_dx)
            y_ND = functional_call(self._modules_list[e], params, (x_in,))
            ds_N = None
            if scale_N is not None:
                ds_N = (gy_ND.float() * y_ND.detach().float()).sum(-1).to(scale_N.dtype)
                gy_ND = gy_ND * scale_N.to(gy_ND.dtype).unsqueeze(1)
            inputs = ([x_in] if need_dx else []) + list(params.values())
            grads = torch.autograd.grad(y_ND, inputs, gy_ND, allow_unused=True)
        dx_ND = grads[0] if need_dx else None
        wgrads = [torch.zeros_like(p) if g is None else g
                  for p, g in zip(params.values(), grads[1 if need_dx else 0:])]
        return dx_ND, wgrads, ds_N

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return functional_call(self._modules_list[e],
                                   self.layout.split(self.master(e).to(x_ND.device,
                                                                       x_ND.dtype)), (x_ND,))

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, num_experts={self.num_experts}, modules, offloaded"
