"""Expert containers: stacked FFN/GLU experts, or any list of nn.Modules.

Both are expert containers (moescale.dispatch.protocol): `forward_rows(x_RD, counts)` maps rows
grouped by expert (`counts[e]` consecutive rows for expert e) to outputs in the same order.
`GroupedExperts` declares ROUTED (`forward_routed(x_TD, plan)` fuses gather, experts and
combine for the local case), GROUPED_WEIGHTS (`weights(dtype)`: the pipelined all-to-all runs
the grouped kernels on them) and FFN_SHAPE; `ModuleExperts` declares nothing beyond the seam.
`expert_forward(e, x)` runs one expert with plain autograd ops: the reference oracle uses it.

Legend: R rows, T tokens, D model width, F expert hidden width, E experts.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import FFN_SHAPE, GROUPED_WEIGHTS, ROUTED, STATE_ACCESS
from moescale.layers.activations import Activation
from moescale.layers.grad_buffers import GradBuffers
from moescale.layers.grouped_ffn import PARAM_NAMES, FFNWeights
from moescale.layers.grouped_ffn_autograd import GroupedFFNRouted, GroupedFFNRows
from moescale.layers.state_access import ResidentAccess


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's own dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """E feed-forward experts with stacked weights `w1_EDF`, `w2_EFD` (+ `w3_EDF` for GLU).

    Plain: y = act(x W1 + b1) W2 + b2. GLU (Llama/Mixtral style): y = (act(x W1) * (x W3)) W2.
    """

    capabilities = frozenset({ROUTED, GROUPED_WEIGHTS, FFN_SHAPE, STATE_ACCESS})

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *,
                 activation: str | Callable = "gelu", glu: bool = False, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(d_ff, int) or d_ff < 1:
            raise ValueError(f"d_ff={d_ff!r} must be a positive integer (the expert hidden "
                             "width, e.g. 4 * d_model)")
        if glu and bias:
            raise ValueError("glu=True with bias=True is not supported; GLU experts are "
                             "bias-free (as in Llama and Mixtral): set bias=False")
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.glu, self.act = glu, Activation(activation)
        kw = dict(device=device, dtype=dtype)
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model, **kw))
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw)) if glu else None
        self.b1_EF = nn.Parameter(torch.empty(num_experts, d_ff, **kw)) if bias else None
        self.b2_ED = nn.Parameter(torch.empty(num_experts, d_model, **kw)) if bias else None
        # one draw of the global RNG, on any device: each expert's init comes from its own
        # generator, so experts built on the meta device (offloaded, initialised one at a
        # time by init_values) get the very numbers a materialised build gets
        self.init_seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
        # the stacked weight gradients' storage, kept from one backward to the next on a CPU
        # (grad_buffers.py: no page faults per step; `release_grad_buffers()` drops it)
        self.grad_buffers = GradBuffers()
        self.reset_parameters()

    def init_values(self, e: int, std: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Expert e's initial fp32 tensors (name -> shape without the expert dim), from its own
        generator. std: name -> standard deviation of a normal init (zeros for biases not
        named); None: nn.Linear's default uniform init."""
        gen = torch.Generator().manual_seed(self.init_seed + e)
        bounds = {"w1_EDF": 1.0 / math.sqrt(self.d_model), "w2_EFD": 1.0 / math.sqrt(self.d_ff),
                  "w3_EDF": 1.0 / math.sqrt(self.d_model), "b1_EF": 1.0 / math.sqrt(self.d_model),
                  "b2_ED": 1.0 / math.sqrt(self.d_ff)}
        out = {}
        for name, p in self.named_parameters(recurse=False):
            t = torch.empty(p.shape[1:], dtype=torch.float32)
            if std is None:
                t.uniform_(-bounds[name], bounds[name], generator=gen)
            elif name in std:
                t.normal_(0.0, std[name], generator=gen)
            else:
                t.zero_()
            out[name] = t
        return out

    @torch.no_grad()
    def init_(self, std: dict[str, float] | None = None) -> None:
        """Initialise every expert with init_values (nothing to do on the meta device)."""
        if self.w1_EDF.is_meta:
            return
        for e in range(self.num_experts):
            for name, t in self.init_values(e, std).items():
                getattr(self, name)[e].copy_(t)

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert."""
        self.init_(None)

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def release_grad_buffers(self) -> None:
        """Hand back the gradient storage kept between backward passes (grad_buffers.py), e.g.
        before evaluation; a .grad still set stays valid."""
        self.grad_buffers.release()

    @property
    def bias(self) -> bool:
        return self.b1_EF is not None

    def weights(self, dtype: torch.dtype | None = None) -> FFNWeights:
        """The stacked weights, cast (differentiably) to the compute dtype."""
        def cast(p):
            return p if p is None or dtype is None else p.to(dtype)
        return FFNWeights(*(cast(p) for p in
                            (self.w1_EDF, self.w2_EFD, self.w3_EDF, self.b1_EF, self.b2_ED)))

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        x_RD = x_RD.to(compute_dtype(x_RD))
        w = self.weights(x_RD.dtype)
        return GroupedFFNRows.apply(x_RD.contiguous(), tuple(counts), self.act,
                                    self.grad_buffers, w.w1_EDF, w.w2_EFD, w.w3_EDF, w.b1_EF,
                                    w.b2_ED)

    def forward_routed(self, x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        x_TD = x_TD.to(compute_dtype(x_TD))
        w = self.weights(x_TD.dtype)
        return GroupedFFNRouted.apply(x_TD.contiguous(), plan.scores_R, plan.token_idx_R,
                                      tuple(plan.counts), self.act, self.grad_buffers,
                                      w.w1_EDF, w.w2_EFD, w.w3_EDF, w.b1_EF, w.b2_ED)

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x_ND with plain autograd ops (slow; the reference uses it)."""
        h_NF = x_ND @ self.w1_EDF[e]
        if self.b1_EF is not None:
            h_NF = h_NF + self.b1_EF[e]
        a_NF = self.act.forward(h_NF)
        if self.glu:
            a_NF = a_NF * (x_ND @ self.w3_EDF[e])
        y_ND = a_NF @ self.w2_EFD[e]
        if self.b2_ED is not None:
            y_ND = y_ND + self.b2_ED[e]
        return y_ND

    def state_access(self, key: str, optimizer=None, engine=None) -> ResidentAccess:
        """STATE_ACCESS: the stacked parameters, expert dim first (moescale.layers.state_access)."""
        return ResidentAccess(key, optimizer, stacked=[
            (n, getattr(self, n)) for n in PARAM_NAMES if getattr(self, n) is not None])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
                f"activation={self.act.name}, glu={self.glu}, bias={self.b1_EF is not None}")


class ModuleExperts(nn.Module):
    """Any modules as experts (FastMoE's "any module"): each maps [N, D] to [N, D].

    Heterogeneous lists are fine; the experts run one after another on their rows.
    """

    capabilities: frozenset[str] = frozenset({STATE_ACCESS})

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        modules = list(modules)
        if not modules:
            raise ValueError("experts=[] is empty; give at least one expert module")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise ValueError(f"experts[{i}] is a {type(m).__name__}, not an nn.Module; "
                                 "pass modules or a factory returning modules")
        self.experts = nn.ModuleList(modules)
        self.num_experts = len(modules)

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        outputs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                y_ND = self.experts[e](x_RD[start:start + n])
                if y_ND.shape != (n, x_RD.shape[1]):   # a wrong width would mix silently
                    raise ValueError(f"expert {e} ({type(self.experts[e]).__name__}) maps "
                                     f"[{n}, {x_RD.shape[1]}] rows to {list(y_ND.shape)}; an "
                                     f"expert must return [rows, d_model={x_RD.shape[1]}]")
                outputs.append(y_ND)
            start += n
        if not outputs:
            return x_RD.new_zeros(x_RD.shape)
        return torch.cat(outputs, dim=0)

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x_ND)

    def state_access(self, key: str, optimizer=None, engine=None) -> ResidentAccess:
        """STATE_ACCESS: one module per expert (moescale.layers.state_access)."""
        return ResidentAccess(key, optimizer, modules=self.experts)
