"""A residency in one file: each expert's weights a dict of plain tensors, stepped by its own AdamW.

What a new residency needs and nothing more, handed to the trainer from outside the library
(`Trainer(config, run_dir, residency=DictResidency)`, or across process spawn
`train_distributed(..., residency="tests/train/dict_residency.py:DictResidency")`):

- `DictExperts`, the expert container (moescale.dispatch.protocol): per held expert l a dict
  {name: leaf tensor} under GroupedExperts' names (w1_EDF [D, F], w2_EFD [F, D], w3_EDF, b1_EF,
  b2_ED, one expert's slice each), not parameters of the model (the dense AdamW never sees
  them). `forward_rows` runs the held experts one after another on their rows by plain ops;
  STATE_ACCESS reads and writes them and their AdamW moments (`DictState`), so expert shards,
  resharding and export go through the library's own code; GRAD_TENSORS names these tensors
  (`grad_tensors()`), which the pipelined exchange's AutogradChunkRunner differentiates
  instead of `parameters()` (a dict of plain tensors has none); FFN_SHAPE lets the pipelined
  exchange's `reuse auto` model it.
- `DictStep`, the expert-step handle (moescale.expert_step.ExpertStep): after backward it sums
  the partial gradients of experts that every rank of the expert-parallel group holds (dynamic
  placement: each rank computed only the rows placed on it), averages over data-parallel
  replicas, clips by the global norm together with the dense gradients and steps every held
  expert with torch AdamW's arithmetic at the dense optimizer's learning rate, betas, eps and
  weight decay (so a run logs the losses of resident training).
- `DictResidency` (moescale.train.parts.Residency): `prepare` swaps every MoE layer's experts
  (or an expert-parallel shard's `local`) for `DictExperts` holding the same values, read
  through their STATE_ACCESS; `shard_role`: sharded experts are written by one data-parallel
  replica, experts replicated over the group (dynamic placement) by rank 0 alone, and every
  rank loads all it holds.

Legend: R rows grouped by held expert, N rows of one expert, D model width, F expert width.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
from torch import nn

from moescale.dispatch.protocol import (FFN_SHAPE, GRAD_TENSORS, GROUPED_WEIGHTS, SHARD,
                                        STATE_ACCESS, capabilities_of)
from moescale.layers.moe import MoE
from moescale.parallel.dense_shard import grad_square_sum

Tensors = dict[str, torch.Tensor]


class DictExperts(nn.Module):
    """Held experts as dicts of plain leaf tensors (see the module docstring)."""

    capabilities = frozenset({FFN_SHAPE, GRAD_TENSORS, STATE_ACCESS})

    def __init__(self, num_experts: int, act, weights: list[Tensors]) -> None:
        super().__init__()
        self.num_experts, self.act = num_experts, act
        self.weights = [{n: t.detach().clone().requires_grad_(True) for n, t in w.items()}
                        for w in weights]
        self.moments: list[tuple[Tensors, Tensors, float] | None] = [None] * len(weights)
        first = self.weights[0]
        self.d_model, self.d_ff = first["w1_EDF"].shape
        self.glu, self.bias = "w3_EDF" in first, "b1_EF" in first

    @property
    def expert_ids(self) -> range:
        return range(len(self.weights))      # a shard's `local`: ids relative to the shard

    def leaves(self) -> list[torch.Tensor]:
        return [t for w in self.weights for t in w.values()]

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.leaves()

    def _ffn(self, l: int, x_ND: torch.Tensor) -> torch.Tensor:
        w = self.weights[l]
        h_NF = x_ND @ w["w1_EDF"]
        if self.bias:
            h_NF = h_NF + w["b1_EF"]
        a_NF = self.act.forward(h_NF)
        if self.glu:
            a_NF = a_NF * (x_ND @ w["w3_EDF"])
        y_ND = a_NF @ w["w2_EFD"]
        return y_ND + w["b2_ED"] if self.bias else y_ND

    def forward_rows(self, x_RD: torch.Tensor, counts_E: Sequence[int]) -> torch.Tensor:
        outputs, start = [], 0
        for l, n in enumerate(counts_E):
            if n:
                outputs.append(self._ffn(l, x_RD[start:start + n]))
            start += n
        return torch.cat(outputs) if outputs else x_RD.new_zeros(x_RD.shape)

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        return self._ffn(e, x_ND)

    def state_access(self, key: str, optimizer=None, engine=None) -> "DictState":
        return DictState(self)


class DictState:
    """DictExperts' state, one expert at a time (moescale.layers.state_access.ExpertState)."""

    tier = "dict"     # neither resident parameters nor a store's records
    store = None
    engine = None
    stacked = True    # a layer's tensors are named GroupedExperts' way, stacked [E, ...]

    def __init__(self, experts: DictExperts) -> None:
        self.experts = experts
        self.spec = [(n, tuple(t.shape)) for n, t in experts.weights[0].items()]

    def masters(self, l: int) -> Tensors:
        return {n: t.detach().to(torch.float32, copy=True)
                for n, t in self.experts.weights[l].items()}

    def read(self, l: int):
        return ({n: t.detach() for n, t in self.experts.weights[l].items()},
                self.experts.moments[l])

    @torch.no_grad()
    def write(self, l: int, master: Tensors, moments) -> None:
        for n, t in self.experts.weights[l].items():
            t.copy_(master[n])
        self.experts.moments[l] = None if moments is None else (
            {n: v.detach().clone() for n, v in moments[0].items()},
            {n: v.detach().clone() for n, v in moments[1].items()}, float(moments[2]))

    def finish(self) -> None:
        pass


class DictStep:
    """Sums, clips and steps the DictExperts of a run (see the module docstring)."""

    def __init__(self, layers: list[DictExperts], groups, replicated: bool) -> None:
        self.layers, self.groups, self.replicated = layers, groups, replicated
        self.optimizer = None

    def follow(self, optimizer) -> None:
        self.optimizer = optimizer      # its first group: matrices, with weight decay

    def begin_micro_batch(self, last: bool) -> None:
        pass

    def before_backward(self, loss) -> None:
        pass

    def _grads(self) -> list[torch.Tensor]:
        for t in (t for x in self.layers for t in x.leaves()):
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        return [t.grad for x in self.layers for t in x.leaves()]

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        grads, g = self._grads(), self.groups
        if g is not None and self.replicated and g.ep_size > 1:   # partial gradients
            for grad in grads:
                dist.all_reduce(grad, group=g.ep_group)
        if g is not None and g.dp_size > 1:                        # replicas' gradients
            for grad in grads:
                dist.all_reduce(grad, group=g.dp_group)
                grad.div_(g.dp_size)
        expert_sq = sum(grad.double().square().sum() for grad in grads).reshape(1)
        if g is not None and not self.replicated and g.ep_size > 1:   # disjoint shards
            dist.all_reduce(expert_sq, group=g.ep_group)
        dense = [p.grad for p in model.parameters() if p.grad is not None]
        sharded = [d for d in dense if isinstance(d, DTensor)]   # parallel.dense shard: the
        dense_sq = (float(grad_square_sum(sharded)) if sharded else 0.0) + sum(  # shards'
            float(d.double().square().sum()) for d in dense if not isinstance(d, DTensor))
        total = math.sqrt(float(expert_sq[0]) + dense_sq)    # squares summed over the mesh
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for grad in grads + dense:
                grad.mul_(coef)
        return total

    def skipped_steps(self) -> int:
        return 0

    @torch.no_grad()
    def step(self) -> None:
        """torch AdamW's arithmetic on every held expert (an expert no row reached steps with
        a zero gradient, as a stacked resident parameter does)."""
        group = self.optimizer.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], \
            group["weight_decay"]
        for x in self.layers:
            for l, weights in enumerate(x.weights):
                exp_avg, exp_avg_sq, step = x.moments[l] or (
                    {n: torch.zeros_like(t) for n, t in weights.items()},
                    {n: torch.zeros_like(t) for n, t in weights.items()}, 0.0)
                step += 1
                for n, t in weights.items():
                    grad = t.grad
                    t.mul_(1 - lr * wd)
                    exp_avg[n].lerp_(grad, 1 - beta1)
                    exp_avg_sq[n].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denom = (exp_avg_sq[n].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                    t.addcdiv_(exp_avg[n], denom, value=-lr / (1 - beta1 ** step))
                x.moments[l] = (exp_avg, exp_avg_sq, step)
        self.skip_step()

    def skip_step(self) -> None:
        for x in self.layers:
            for t in x.leaves():
                t.grad = None

    def take_wait_s(self) -> float:
        return 0.0

    def memory(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class DictResidency:
    """Experts in DictExperts (see the module docstring); made from the run config."""

    engine = None              # no offload engine behind these experts
    streams_experts = False

    def __init__(self, config) -> None:
        # dynamic placement computes every expert on every rank of the node: replicated there
        self.replicated = config.parallel.placement == "dynamic"
        self.layers: list[DictExperts] = []

    def expert_device(self) -> str | None:
        return None

    def prepare(self, model: nn.Module, exchange) -> DictStep:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            holder, attr = (moe.experts, "local") if SHARD in capabilities_of(moe.experts) \
                else (moe, "experts")
            old = getattr(holder, attr)
            if GROUPED_WEIGHTS not in capabilities_of(old):
                raise ValueError(f"DictResidency takes FFN experts (GROUPED_WEIGHTS); this "
                                 f"layer has {type(old).__name__}")
            access = old.state_access("experts")
            new = DictExperts(old.num_experts, old.act,
                              [access.masters(l) for l in range(len(old.expert_ids))])
            setattr(holder, attr, new)
            self.layers.append(new)
        return DictStep(self.layers, exchange.groups, self.replicated)

    def shard_role(self, exchange) -> tuple[bool, None]:
        g = exchange.groups
        if g is None:
            return True, None
        return g.dp_rank == 0 and (not self.replicated or g.ep_rank == 0), None

    def describe(self, device, where: str) -> tuple[str, str]:
        n = sum(len(x.weights) for x in self.layers)
        return "dict", f"{n} experts in dicts of plain tensors on {device}" + \
            (f"; {where}" if where else "")

    def close(self) -> None:
        self.layers = []
