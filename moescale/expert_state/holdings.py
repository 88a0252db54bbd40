"""What expert state this process holds, and how to read or write one expert of it.

`held_layers(model, optimizer=None, engine=None)` walks the model's MoE layers and returns one
`HeldLayer` each: its key (the single-process state-dict prefix `<moe name>.experts`), the
layer's expert count E, the GLOBAL ids of the experts held here (an `ExpertShard`'s
`expert_ids`, else 0..E-1), the tensors of one expert (names and shapes, the store layout's
order) and an accessor:

- `ResidentAccess`: `GroupedExperts` (stacked parameters, expert dim first) or `ModuleExperts`
  (one module per expert), alone or as a shard's `local`; AdamW's `exp_avg`, `exp_avg_sq` and
  `step` live in the caller's torch optimizer (torch keeps one step per parameter, so one per
  layer tensor; every expert of it shares it);
- `StoreAccess`: a layer of an `ExpertStore` (offloaded experts, alone or as a shard's local,
  and the dynamic-placement store shared by a node's ranks, computed in place or streamed):
  per expert the master, the two moments and a step count. The gradient accumulator is not
  state between steps: writing an expert zeroes it.

`expert_state_keys(model)` / `expert_parameters(model)` name what a dense checkpoint leaves out
(the expert tensors of `model.state_dict()` and the resident expert parameters).

Not here: files (save.py, load.py). A copy of an expert is never made beyond one tensor at a
time: reads return views, writes copy into the container.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.layers.moe import MoE
from moescale.models.resident import dense_state_dict
from moescale.offload.experts import OffloadedExpertsBase
from moescale.offload.records import STATE
from moescale.offload.store import ExpertStore
from moescale.shared_store.experts import SharedStoreExperts
from moescale.shared_store.streamed import StreamedSharedExperts
from moescale.parallel.expert_parallel import ExpertShard

STACKED = ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED")   # the store layout's order
ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}
Tensors = dict[str, torch.Tensor]
Moments = tuple[Tensors, Tensors, float]        # exp_avg, exp_avg_sq, step


class ResidentAccess:
    """Experts that are parameters; their AdamW state in `optimizer` (None: weights only)."""

    tier = "resident"

    def __init__(self, key: str, container: nn.Module, optimizer) -> None:
        self.key, self.optimizer = key, optimizer
        if isinstance(container, GroupedExperts):
            self._stacked = [(n, getattr(container, n)) for n in STACKED
                             if getattr(container, n) is not None]
            self._modules = None
            self.spec = [(n, tuple(p.shape[1:])) for n, p in self._stacked]
        else:
            self._stacked, self._modules = None, list(container.experts)
            specs = [[(n, tuple(p.shape)) for n, p in m.named_parameters()]
                     for m in self._modules]
            if any(s != specs[0] for s in specs):
                raise ValueError(f"{key}: module experts with different parameters cannot be "
                                 f"checkpointed per expert ({specs[0]} vs others); give every "
                                 "expert the same parameters")
            self.spec = specs[0]
        self._touched: dict[int, tuple[nn.Parameter, list]] = {}

    def tensors(self, l: int) -> list[tuple[str, nn.Parameter, int | None]]:
        """(name, parameter, index in its expert dim or None) of local expert l's tensors."""
        if self._stacked is not None:
            return [(n, p, l) for n, p in self._stacked]
        return [(n, p, None) for n, p in self._modules[l].named_parameters()]

    @staticmethod
    def _part(t: torch.Tensor, index: int | None) -> torch.Tensor:
        return t if index is None else t[index]

    def read(self, l: int) -> tuple[Tensors, Moments | None]:
        master = {n: self._part(p.detach(), i) for n, p, i in self.tensors(l)}
        if self.optimizer is None:
            return master, None
        states = [(n, self.optimizer.state.get(p), i) for n, p, i in self.tensors(l)]
        have = [bool(s) and "exp_avg" in s for _, s, _ in states]
        if not any(have):
            return master, None        # never stepped: no state, as torch's AdamW
        if not all(have):
            raise ValueError(f"{self.key}: the optimizer holds state for some of expert "
                             f"{l}'s tensors only; step every expert tensor with one AdamW")
        for n, s, _ in states:
            if set(s) - ADAM_KEYS:
                raise ValueError(f"{self.key}.{n}: optimizer state {sorted(s)} is not plain "
                                 "Adam/AdamW (exp_avg, exp_avg_sq, step); expert shards save "
                                 "only those (amsgrad and other optimizers are not supported)")
        steps = {float(s["step"]) for _, s, _ in states}
        if len(steps) != 1:
            raise ValueError(f"{self.key}: expert {l}'s tensors were stepped {sorted(steps)} "
                             "times; a checkpoint keeps one step count per expert")
        return master, ({n: self._part(s["exp_avg"], i) for n, s, i in states},
                        {n: self._part(s["exp_avg_sq"], i) for n, s, i in states},
                        steps.pop())

    def _state(self, p: nn.Parameter) -> dict:
        state = self.optimizer.state.get(p)
        if state and "exp_avg" in state:
            return state
        group = next((g for g in self.optimizer.param_groups
                      if any(q is p for q in g["params"])), None)
        if group is None:
            raise ValueError(f"{self.key}: the optimizer does not hold this expert parameter; "
                             "pass the optimizer that steps the model's expert parameters")
        on_device = bool(group.get("fused") or group.get("capturable"))
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not \
            group.get("fused") else torch.float32      # torch's own choice for `step`
        state = self.optimizer.state[p] = dict(
            step=torch.zeros((), dtype=dtype, device=p.device if on_device else "cpu"),
            exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
            exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        return state

    @torch.no_grad()
    def write(self, l: int, master: Tensors, moments: Moments | None) -> None:
        for n, p, i in self.tensors(l):
            self._part(p.data, i).copy_(master[n])
            if self.optimizer is None:
                continue
            self._touched.setdefault(id(p), (p, []))[1].append(None if moments is None
                                                               else moments[2])
            if moments is not None:
                state = self._state(p)
                self._part(state["exp_avg"], i).copy_(moments[0][n])
                self._part(state["exp_avg_sq"], i).copy_(moments[1][n])

    def finish(self) -> None:
        """After every write: each parameter's step (one per tensor in torch), or no state
        when the checkpoint had none for its experts."""
        touched, self._touched = self._touched, {}
        for p, steps in touched.values():
            if all(s is None for s in steps):
                self.optimizer.state.pop(p, None)
                continue
            if any(s is None for s in steps) or len(set(steps)) != 1:
                raise ValueError(f"{self.key}: the checkpoint's experts of one parameter have "
                                 f"step counts {sorted(set(steps), key=str)}; torch's AdamW "
                                 "keeps one per parameter. Load it into offloaded experts "
                                 "(a store keeps one per expert)")
            self._state(p)["step"].fill_(steps[0])


class StoreAccess:
    """One layer of an ExpertStore: records of master, gradient accumulator and moments."""

    def __init__(self, key: str, store: ExpertStore, layer: int) -> None:
        self.key, self.store, self.layer = key, store, layer
        layout = store.layouts[layer]
        self.spec = list(zip(layout.names, layout.shapes))
        self.layout = layout

    @property
    def tier(self) -> str:
        return self.store.config.tier

    def read(self, l: int) -> tuple[Tensors, Moments]:
        """A host-tier record's fp32 state: views, or decoded copies of compact state (the
        disk tier is saved by linking its files)."""
        assert self.tier == "host", "disk-tier records are linked, not read"
        key, split = (self.layer, l), self.layout.split
        if not self.store.format.exact:
            master_P, exp_avg_P, exp_avg_sq_P = self.store.get_state(key)
            return split(master_P), (split(exp_avg_P), split(exp_avg_sq_P),
                                     self.store.step_of(key))
        rec = self.store.acquire(key)
        self.store.release(key)
        return split(rec.master_P), (split(rec.exp_avg_P), split(rec.exp_avg_sq_P),
                                     float(rec.step_t))

    @torch.no_grad()
    def write(self, l: int, master: Tensors, moments: Moments | None) -> None:
        key = (self.layer, l)
        if not self.store.format.exact:    # encoded in the store's format
            flat = [None if values is None else
                    torch.cat([values[n].reshape(-1).float() for n in self.layout.names])
                    for values in (master, *(moments[:2] if moments else (None, None)))]
            self.store.put_state(key, *flat)
            self.store.set_step(key, 0.0 if moments is None else moments[2])
            self.store.bump_version(key)
            return
        rec = self.store.acquire(key, STATE)
        try:
            split = self.layout.split
            for rows, values in ((rec.master_P, master),
                                 (rec.exp_avg_P, None if moments is None else moments[0]),
                                 (rec.exp_avg_sq_P, None if moments is None else moments[1])):
                for name, view in split(rows).items():
                    if values is None:
                        view.zero_()
                    else:
                        view.copy_(values[name])
            if rec.data_4P is not None:       # host tier; the disk tier drops the row below
                rec.grad_P.zero_()
            self.store.set_step(key, 0.0 if moments is None else moments[2])
            self.store.bump_version(key)      # device copies of the old state are stale
        finally:
            self.store.release(key, dirty=True, rows=STATE, grad_zero=True)

    def finish(self) -> None:
        pass


@dataclass
class HeldLayer:
    """One MoE layer's experts held by this process (see the module docstring)."""

    key: str
    num_experts: int
    expert_ids: range
    access: ResidentAccess | StoreAccess
    engine: object = None      # the OffloadEngine of offloaded experts (synchronized first)

    @property
    def spec(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.access.spec


def _moes(model: nn.Module, need: bool = True) -> list[tuple[str, MoE]]:
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not found and need:
        raise ValueError("the model has no moescale MoE layer; expert shards hold the experts "
                         "of MoE layers (build the model with moescale.MoE)")
    return found


def held_layers(model: nn.Module, optimizer=None, engine=None) -> list[HeldLayer]:
    """One HeldLayer per MoE layer of `model`, in module order (see the module docstring).
    `engine`: the OffloadEngine of offloaded experts (default: the one they name)."""
    out = []
    for name, moe in _moes(model):
        key = f"{name}.experts" if name else "experts"
        experts, total = moe.experts, moe.experts.num_experts
        ids, inner, owner = range(total), experts, None
        if isinstance(experts, ExpertShard):
            ids, inner = experts.expert_ids, experts.local
        if isinstance(inner, (GroupedExperts, ModuleExperts)):
            access = ResidentAccess(key, inner, optimizer)
        elif isinstance(inner, OffloadedExpertsBase):
            owner = engine if engine is not None else inner.engine
            access = StoreAccess(key, owner.store, inner.layer_index)
        elif isinstance(inner, (SharedStoreExperts, StreamedSharedExperts)):
            access = StoreAccess(key, inner.store, inner.layer_index)
        else:
            raise ValueError(f"{key}: expert container {type(inner).__name__} is not one that "
                             "expert shards know (GroupedExperts, ModuleExperts, offloaded "
                             "experts, the shared store)")
        if isinstance(access, StoreAccess) and access.store.num_experts[access.layer] != len(ids):
            raise ValueError(f"{key}: store layer {access.layer} holds "
                             f"{access.store.num_experts[access.layer]} experts, the layer "
                             f"{len(ids)}; pass the engine these experts were offloaded by")
        out.append(HeldLayer(key, total, ids, access, owner))
    return out


def expert_state_keys(model: nn.Module) -> set[str]:
    """The keys of `model.state_dict()` that are expert state (saved by the expert shards, so
    a dense checkpoint leaves them out; none in a model without MoE layers)."""
    prefixes = [f"{name}.experts." if name else "experts." for name, _ in _moes(model, False)]
    return {k for k in dense_state_dict(model) if any(k.startswith(p) for p in prefixes)}


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The resident expert parameters of `model` (their optimizer state is the shards')."""
    seen, out = set(), []
    for _, moe in _moes(model, False):
        for p in moe.experts.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
