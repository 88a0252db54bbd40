"""Portable state dicts for expert-parallel models: gather the shards, or load a full dict.

`full_state_dict(model, groups)` returns, on every rank of the EP group, the state dict the
single-process model would have: each `ExpertShard`'s slice is all-gathered over the EP group
and its keys are renamed back (`...experts.local.w1_EDF` [L, ...] -> `...experts.w1_EDF`
[E, ...]; ModuleExperts' `...experts.local.experts.i.*` -> `...experts.experts.<global i>.*`).
Replicated entries are this rank's (identical everywhere after gradient averaging).
`load_full_state_dict(model, state, groups)` is the inverse: each rank copies its slice. So a
checkpoint written by one EP size loads at any other, and into the single-process model.

Collective (every EP rank calls it together). It does not write files (the trainer's
checkpoint code does, atomically) and does not touch optimizer state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moescale.layers.experts import GroupedExperts
from moescale.models.resident import dense_state_dict
from moescale.parallel.all_to_all import collective_errors
from moescale.parallel.expert_parallel import ExpertShard
from moescale.parallel.groups import ParallelGroups


def _shards(model: nn.Module) -> dict[str, ExpertShard]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertShard)}


def _owner(shards: dict[str, ExpertShard], key: str) -> str | None:
    """The name of the ExpertShard whose local experts hold state key `key` (None: replicated)."""
    return next((n for n in shards if key.startswith(n + ".local.")), None)


def _full_key(shard_name: str, shard: ExpertShard, local_key: str) -> str:
    """`local_key` is relative to `shard.local`; returns the single-process model's key."""
    if isinstance(shard.local, GroupedExperts):
        return f"{shard_name}.{local_key}"
    _, index, rest = local_key.split(".", 2)          # "experts.<i>.<rest>"
    return f"{shard_name}.experts.{shard.expert_ids.start + int(index)}.{rest}"


def full_state_dict(model: nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """The single-process model's state dict, assembled from the EP shards (on every rank)."""
    shards = _shards(model)
    state = {key: value for key, value in dense_state_dict(model).items()
             if _owner(shards, key) is None}
    for name, shard in shards.items():
        local = shard.local.state_dict()
        if isinstance(shard.local, GroupedExperts):     # same keys and shapes on every rank
            for local_key, value in local.items():
                parts = [torch.empty_like(value) for _ in range(groups.ep_size)]
                with collective_errors("state gather", groups.ep_group):
                    dist.all_gather(parts, value.contiguous(), group=groups.ep_group)
                state[_full_key(name, shard, local_key)] = torch.cat(parts, 0)
            continue
        # any modules (possibly different per rank): one object gather per layer
        device = next(iter(local.values())).device if local else None
        parts = [None] * groups.ep_size
        with collective_errors("state gather", groups.ep_group):
            dist.all_gather_object(parts, (shard.expert_ids.start,
                                           {k: v.cpu() for k, v in local.items()}),
                                   group=groups.ep_group)
        for start, entries in parts:
            for key, tensor in entries.items():
                _, index, rest = key.split(".", 2)
                state[f"{name}.experts.{start + int(index)}.{rest}"] = tensor.to(device)
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                         groups: ParallelGroups) -> None:
    """Load a single-process state dict into an expert-parallel model (this rank's slice)."""
    shards = _shards(model)
    local_state = {}
    for key, value in dense_state_dict(model).items():
        owner = _owner(shards, key)
        if owner is None:
            source_key = key
            source = state.get(source_key)
        else:
            shard = shards[owner]
            local_key = key[len(owner) + len(".local."):]
            source_key = _full_key(owner, shard, local_key)
            source = state.get(source_key)
            if source is not None and isinstance(shard.local, GroupedExperts):
                if source.shape[0] != shard.num_experts:
                    raise ValueError(f"{source_key} holds {source.shape[0]} experts but the "
                                     f"layer has {shard.num_experts}; the checkpoint is of "
                                     "another model")
                source = source[shard.expert_ids.start:shard.expert_ids.stop]
        if source is None:
            raise ValueError(f"the state dict lacks {source_key!r} (needed for {key!r}); it "
                             "is not a checkpoint of this model")
        local_state[key] = source
    model.load_state_dict(local_state)
