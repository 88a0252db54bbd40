"""A plain resident model back from an offloaded one, and a state_dict() that says where experts are.

After `offload_moe(model)` the experts live in the engine's ExpertStore, not in the module
tree, so `model.state_dict()` holds no expert tensor. Two ways back:

- `consolidated_state_dict(model)` (models/checkpoint.py): the full state dict, every expert's
  fp32 master under the names a resident model uses (`<moe>.experts.w1_EDF` [E, D, F], ...),
  without changing the model; `torch.save` it, or load it into a resident model.
- `resident_model(model)`: in place, every offloaded MoE layer gets plain experts again
  (`GroupedExperts`, or `ModuleExperts` for module experts; inside an expert-parallel
  `ExpertShard` its local experts), holding the store's fp32 masters on the device of the
  layer's router. The model is then an ordinary module: `state_dict()`, `torch.save`, `save_pretrained` of a
  converted transformers model, `export_mixtral`, inference without the engine. The engine
  `offload_moe` returned is no longer used by the model; `engine.close()` releases its
  threads, cache and store (the caller's, as before).

`warn_offloaded_state_dict` is the state-dict hook `offload_moe` registers on each offloaded
container: `model.state_dict()` then warns (OffloadedExpertsWarning) naming the layer and both
calls, instead of silently omitting the experts. moescale's own savers, which write the experts
apart, read the dense half with `dense_state_dict(model)`, which does not warn.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from moescale.dispatch.protocol import SHARD, STATE_ACCESS, ExpertContainer
from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.layers.moe import MoE
from moescale.layers.shard import mark_expert_parameters


class OffloadedExpertsWarning(UserWarning):
    """model.state_dict() of an offloaded model: the experts are not in it."""


def is_offloaded(module: nn.Module) -> bool:
    """Whether `module` is an expert container whose experts live outside the module tree: it
    declares STATE_ACCESS and holds no parameter (an offloaded or node store, or any other
    residency's tensors; an ExpertShard answers through its `local`)."""
    if not isinstance(module, ExpertContainer):
        return False
    caps = module.capabilities
    return STATE_ACCESS in caps and SHARD not in caps and \
        next(module.parameters(), None) is None


def expert_masters(experts: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Copies of every held expert's fp32 master tensors, through the container's
    state_access (after its engine's queued steps)."""
    access = experts.state_access("experts")
    if access.engine is not None:
        access.engine.synchronize()
    return [access.masters(l) for l in range(len(experts.expert_ids))]


def warn_offloaded_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post hook of an offloaded container (registered by offload_moe)."""
    if getattr(module, "quiet_state_dict", False):
        return
    warnings.warn(f"{prefix.rstrip('.') or 'experts'}: the experts are offloaded (offload_moe), "
                  "so state_dict() does not hold them; use "
                  "moescale.models.consolidated_state_dict(model) for a full state dict, or "
                  "moescale.models.resident_model(model) for a plain resident model",
                  OffloadedExpertsWarning, stacklevel=3)


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` without the offloaded-experts warning (for savers that write the
    experts separately)."""
    containers = [m for m in model.modules() if is_offloaded(m)]
    for m in containers:
        m.quiet_state_dict = True
    try:
        return model.state_dict()
    finally:
        for m in containers:
            m.quiet_state_dict = False


def _plain(off: nn.Module, device: torch.device) -> nn.Module:
    """Plain experts holding an offloaded container's fp32 masters."""
    states = expert_masters(off)
    if not off.state_access("experts").stacked:   # module experts: each module gets its own
        modules = off._modules_list
        for m, state in zip(modules, states):
            m.load_state_dict({k: v.detach().clone().to(device) for k, v in state.items()},
                              assign=True)
        return ModuleExperts(modules)
    experts = GroupedExperts(off.num_experts, off.d_model, off.d_ff, activation=off.act.spec,
                             glu=off.glu, bias=off.bias, device=device)
    with torch.no_grad():
        for name, param in experts.named_parameters():
            param.copy_(torch.stack([s[name] for s in states]).reshape(param.shape))
    return experts


def resident_model(model: nn.Module) -> nn.Module:
    """Give every offloaded MoE layer of `model` plain resident experts again (in place; see the
    module docstring); returns `model`. A model with no offloaded layer is returned as it is."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        holder = moe.experts if SHARD in moe.experts.capabilities else moe
        attr = "local" if holder is not moe else "experts"
        off = getattr(holder, attr)
        if not is_offloaded(off):
            continue
        plain = _plain(off, moe.router.weight.device)
        setattr(holder, attr, plain if holder is moe else mark_expert_parameters(plain))
    return model
