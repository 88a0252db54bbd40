"""How an expert's state is read and written, whatever holds it: the `STATE_ACCESS` capability.

A container that declares `STATE_ACCESS` (moescale.dispatch.protocol) offers

  state_access(key, optimizer=None, engine=None) -> ExpertState

for the experts it holds (local index l = 0..len(expert_ids)-1): checkpoints
(moescale.expert_state), export and resharding go through it and never ask which class holds
the experts. `key` names the layer in errors; `optimizer` is the torch optimizer that steps
resident parameters (their AdamW moments live there); `engine` an offload engine to use instead
of the one an offloaded container names.

`ResidentAccess` (here) serves experts that are parameters; an ExpertStore's layer is served by
moescale.offload.store_access.StoreAccess. A new residency returns either, or its own class with
the same face.

Legend: P parameters of one expert.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

ADAM_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
Tensors = dict[str, torch.Tensor]
Moments = tuple[Tensors, Tensors, float]        # exp_avg, exp_avg_sq, step


@runtime_checkable
class ExpertState(Protocol):
    """One layer's held experts' state (see the module docstring)."""

    spec: list[tuple[str, tuple[int, ...]]]  # one expert's tensors: (name, shape), store order
    tier: str          # "resident", or the store's tier: "host" | "disk" (disk records link)
    store: object      # the ExpertStore behind it (disk-tier records are linked), or None
    engine: object     # an offload engine to synchronize before reading or writing, or None
    stacked: bool      # state dicts name the layer's tensors stacked [E, ...] under the spec's
                       # names (GroupedExperts'); False: per expert, `experts.<e>.<name>`

    def masters(self, l: int) -> Tensors:
        """Copies of local expert l's fp32 master tensors, whatever the tier (export)."""

    def read(self, l: int) -> tuple[Tensors, Moments | None]:
        """Local expert l's fp32 master tensors and (exp_avg, exp_avg_sq, step) or None."""

    def write(self, l: int, master: Tensors, moments: Moments | None) -> None:
        """Replace local expert l's state (moments None: fresh optimizer state)."""

    def finish(self) -> None:
        """After every write of a load."""


class ResidentAccess:
    """Experts that are parameters; their AdamW state in `optimizer` (None: weights only).

    Either `stacked`: (name, parameter) pairs whose dim 0 is the expert (GroupedExperts), or
    `modules`: one module per expert (ModuleExperts; every module the same parameters)."""

    tier = "resident"
    store = None      # no ExpertStore behind parameters
    engine = None

    def __init__(self, key: str, optimizer, *, stacked=None, modules=None) -> None:
        self.key, self.optimizer = key, optimizer
        if (stacked is None) == (modules is None):
            raise ValueError("ResidentAccess takes either stacked parameters or modules")
        self.stacked = stacked is not None
        if stacked is not None:
            self._stacked = list(stacked)
            self._modules = None
            self.spec = [(n, tuple(p.shape[1:])) for n, p in self._stacked]
        else:
            self._stacked, self._modules = None, list(modules)
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

    def masters(self, l: int) -> Tensors:
        return {n: self._part(p.detach(), i).to(torch.float32, copy=True)
                for n, p, i in self.tensors(l)}

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
