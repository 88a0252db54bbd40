"""The MoE block: router -> routing plan -> dispatcher -> experts -> combine.

`MoE(d_model, num_experts, top_k, ...)` maps `[..., d_model]` to the same shape. After each call
the layer holds `last_aux_loss` (the weighted balance + z losses of that call, part of the
autograd graph) and `last_stats` (detached numbers for logging); `collect_aux_loss(model)`
sums the former over a model. Nothing is kept in module-level state.

Two seams: the dispatcher owns the exchange (`LocalDispatcher` here; the expert-parallel,
pipelined and dynamic-placement dispatchers plug into the same place without changing the
layer's math), the expert container owns the residency (resident, offloaded, shared store) and
computes rows in expert order (moescale.dispatch.protocol). Any dispatcher composes with any
container that offers what it asks for.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from moescale.config_tree import FlatKeys
from moescale.dispatch.local import LocalDispatcher
from moescale.dispatch.plan import build_plan
from moescale.dispatch.protocol import ExpertContainer
from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.routing.config import RouterConfig, expert_capacity
from moescale.routing.losses import balance_loss, z_loss
from moescale.routing.routers import Router


@dataclass(kw_only=True)
class MoEConfig(FlatKeys):
    """Plain-data description of one MoE layer (validated on construction): the experts' shape,
    capacity and loss weights here, how tokens choose experts in `router` (a RouterConfig,
    which holds num_experts and top_k; `config.num_experts` and `config.top_k` read them).

    Built nested, `MoEConfig(d_model=64, router=RouterConfig(num_experts=4, top_k=1,
    kind="switch"))`, or from flat keys, `MoEConfig.from_flat(d_model=64, num_experts=4,
    top_k=1, router="switch")` (moescale.config_tree), as `MoE(...)`'s keywords are."""

    d_model: int
    d_ff: int | None = None          # expert hidden width; None means 4 * d_model
    activation: str = "gelu"
    glu: bool = False
    bias: bool = False
    capacity_factor: float | None = None   # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.d_model, int) or self.d_model < 1:
            raise ValueError(f"d_model={self.d_model!r} must be a positive integer")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if not isinstance(self.router, RouterConfig):
            raise ValueError(f"router={self.router!r} must be a RouterConfig; a router kind "
                             "goes in RouterConfig(kind=...), or use MoEConfig.from_flat("
                             "router=...)")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and 0 < cf < math.inf):
            raise ValueError(f"capacity_factor={cf!r} must be a finite number > 0, or None for "
                             "dropless routing")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}={getattr(self, name)!r} must be finite and >= 0")

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k


@dataclass
class MoEStats:
    """Detached numbers from the last call, for logging."""

    num_tokens: int
    routed_E: torch.Tensor     # routing choices per expert, before capacity
    num_dropped: int
    balance_loss: torch.Tensor  # detached scalar (no host sync until read)
    z_loss: torch.Tensor


def _build_experts(cfg: MoEConfig, experts, activation, device, dtype):
    if experts is None:
        return GroupedExperts(cfg.num_experts, cfg.d_model, cfg.d_ff,
                              activation=activation if activation is not None else cfg.activation,
                              glu=cfg.glu, bias=cfg.bias, device=device, dtype=dtype)
    if isinstance(experts, nn.Module) and isinstance(experts, ExpertContainer):
        built = experts
    elif isinstance(experts, (list, tuple, nn.ModuleList)):
        built = ModuleExperts(experts)
    elif isinstance(experts, nn.Module):  # callable, but not a factory
        raise ValueError(f"experts={type(experts).__name__}(...) is a single module; pass one "
                         "module per expert (a list) or a factory, e.g. "
                         "experts=lambda e: copy.deepcopy(module)")
    elif callable(experts):
        built = ModuleExperts([experts(e) for e in range(cfg.num_experts)])
    else:
        raise ValueError(f"experts={experts!r} must be None, a list of nn.Modules, or a "
                         "factory called as factory(expert_index) -> nn.Module")
    if built.num_experts != cfg.num_experts:
        raise ValueError(f"experts holds {built.num_experts} experts but "
                         f"num_experts={cfg.num_experts}; make them agree")
    return built


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward block.

    MoE(d_model, num_experts=8, top_k=2, d_ff=None, activation="gelu", glu=False, bias=False,
        router="topk", renormalize=None, capacity_factor=None, aux_loss_coef=0.01,
        z_loss_coef=0.0, experts=None)

    The keywords are MoEConfig's and its RouterConfig's fields under their flat names
    (`router` is the router kind; jitter_eps, noise_std_min, random_routing too), built by
    `MoEConfig.from_flat`; or pass `config=MoEConfig(...)` whole.
    `experts`: None (stacked FFN/GLU experts built from d_ff/activation/glu/bias), a list of
    nn.Modules (any module mapping [N, d_model] -> [N, d_model]; lists may be heterogeneous;
    num_experts defaults to its length), a factory `factory(e) -> nn.Module`, or an expert
    container (moescale.dispatch.protocol.ExpertContainer).
    `expert_device="meta"` builds stacked experts without memory (to be offloaded with
    `offload_moe(..., expert_init=...)`); the router stays on `device`.
    """

    def __init__(self, d_model: int | None = None, num_experts: int | None = None,
                 top_k: int = 2, *, config: MoEConfig | None = None,
                 experts: Sequence[nn.Module] | Callable[[int], nn.Module] | nn.Module | None = None,
                 activation: str | Callable | None = None, dispatcher=None,
                 device=None, dtype=None, expert_device=None, **options) -> None:
        super().__init__()
        if config is None:
            if num_experts is None:
                num_experts = len(experts) if isinstance(experts, (list, tuple, nn.ModuleList)) \
                    else 8
            if isinstance(activation, str):
                options["activation"] = activation
            config = MoEConfig.from_flat(d_model=d_model, num_experts=num_experts, top_k=top_k,
                                         **options)
        self.config = config
        self.router = Router(config.d_model, config.router, device=device, dtype=dtype)
        self.experts = _build_experts(config, experts, activation,
                                      device if expert_device is None else expert_device, dtype)
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        self.last_aux_loss: torch.Tensor | None = None
        self.last_stats: MoEStats | None = None

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def __getstate__(self):
        # The last call's record is part of that call's autograd graph, which deepcopy and
        # pickle refuse; a copy starts without one, as a freshly built layer does.
        state = super().__getstate__()
        state["last_aux_loss"], state["last_stats"] = None, None
        return state

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"MoE input has dtype {x.dtype}; it must be floating point "
                             "(token ids go through an embedding first, or cast with .float())")
        if x.dim() == 0 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"MoE input has shape {tuple(x.shape)}: its last dimension must be "
                             f"d_model={self.config.d_model}; reshape the input or build the "
                             f"layer with d_model={x.shape[-1] if x.dim() else '?'}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        cfg = self.config
        x_TD = x.reshape(-1, cfg.d_model)
        route = self.router(x_TD)
        capacity = expert_capacity(cfg.capacity_factor, x_TD.shape[0], cfg.top_k,
                                   cfg.num_experts)
        plan = build_plan(route.scores_TK, route.expert_ids_TK, cfg.num_experts, capacity,
                          check_finite=route.logits_TE)
        y_TD = self.dispatcher(x_TD, plan, self.experts)
        self._record_losses(route, plan)
        return y_TD.reshape(x.shape[:-1] + (y_TD.shape[-1],))

    def _record_losses(self, route, plan) -> None:
        cfg = self.config
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.aux_loss_coef > 0):
            bal = balance_loss(route.probs_TE, route.expert_ids_TK, self.dispatcher.reduce_sum)
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.z_loss_coef > 0):
            z = z_loss(route.logits_TE) if cfg.z_loss_coef > 0 else route.logits_TE.new_zeros(())
        self.last_aux_loss = cfg.aux_loss_coef * bal + cfg.z_loss_coef * z
        self.last_stats = MoEStats(num_tokens=plan.num_tokens, routed_E=plan.routed_E.detach(),
                                   num_dropped=plan.num_dropped, balance_loss=bal.detach(),
                                   z_loss=z.detach())


def collect_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of `last_aux_loss` over every MoE layer of `model` (0.0 when none ran)."""
    losses = [m.last_aux_loss for m in model.modules()
              if isinstance(m, MoE) and m.last_aux_loss is not None]
    if not losses:
        param = next(model.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    return torch.stack([loss.float() for loss in losses]).sum()
