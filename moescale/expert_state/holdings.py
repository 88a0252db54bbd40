"""What expert state this process holds, and how to read or write one expert of it.

`held_layers(model, optimizer=None, engine=None)` walks the model's MoE layers and returns one
`HeldLayer` each: its key (the single-process state-dict prefix `<moe name>.experts`), the
layer's expert count E, the GLOBAL ids of the experts held here (the container's
`expert_ids`), the tensors of one expert (names and shapes, the store layout's order) and an
accessor: whatever the container's `state_access` returns (the STATE_ACCESS capability,
moescale.layers.state_access). Which class holds the experts is never asked here:

- resident parameters (`GroupedExperts`, `ModuleExperts`, alone or as a shard's `local`) give a
  `ResidentAccess`: AdamW's `exp_avg`, `exp_avg_sq` and `step` live in the caller's torch
  optimizer (torch keeps one step per parameter, so one per layer tensor; every expert of it
  shares it);
- a layer of an `ExpertStore` (offloaded experts, the node store of dynamic placement) gives a
  `StoreAccess` (moescale.offload.store_access): per expert the master, the two moments and a
  step count;
- a container of another residency gives its own.

`expert_state_keys(model)` / `expert_parameters(model)` name what a dense checkpoint leaves out
(the expert tensors of `model.state_dict()` and the resident expert parameters).

Not here: files (save.py, load.py). A copy of an expert is never made beyond one tensor at a
time: reads return views, writes copy into the container.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moescale.dispatch.protocol import STATE_ACCESS, capabilities_of
from moescale.layers.moe import MoE
from moescale.layers.state_access import ExpertState
from moescale.models.resident import dense_state_dict


@dataclass
class HeldLayer:
    """One MoE layer's experts held by this process (see the module docstring)."""

    key: str
    num_experts: int
    expert_ids: range
    access: ExpertState
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
        experts = moe.experts
        if STATE_ACCESS not in capabilities_of(experts):
            raise ValueError(f"{key}: expert container {type(experts).__name__} does not "
                             "declare the STATE_ACCESS capability, so expert shards cannot read "
                             "or write its experts; give it state_access "
                             "(moescale.layers.state_access)")
        access = experts.state_access(key, optimizer, engine)
        ids = experts.expert_ids
        store = access.store
        if store is not None and store.num_experts[access.layer] != len(ids):
            raise ValueError(f"{key}: store layer {access.layer} holds "
                             f"{store.num_experts[access.layer]} experts, the layer "
                             f"{len(ids)}; pass the engine these experts were offloaded by")
        out.append(HeldLayer(key, experts.num_experts, ids, access, access.engine))
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
