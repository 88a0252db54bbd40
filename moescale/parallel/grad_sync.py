"""Gradient synchronization for expert parallelism: what to reduce over which group.

Semantics (docs/expert_parallel.md): every rank back-propagates its own loss, and the model's
loss is the mean of the ranks' losses (with equal token counts: the mean over all tokens of all
ranks; `global_mean_weight` handles unequal counts). Then:

- replicated parameters (router, attention, embeddings: everything not tagged as expert) carry
  this rank's share and are averaged over the world (what DDP does);
- expert parameters already hold the EP group's contribution at the mean scale (the
  dispatcher's all-to-all backward scales it), and are averaged over the data-parallel group
  of ranks holding the same shard (a no-op when every rank holds different experts).

`ddp_ignore_names` lists the expert parameters for DDP's ignore list (FSDP: pass
`expert_parameters(model)` as `ignored_states`). `clip_grad_norm_` clips by the global norm:
replicated gradients counted once, expert gradients summed over the EP group.

`allreduce_gradients` does not overlap reduction with backward and does not shard optimizer
state. The trainer's replicated dense half goes through DDP instead (dense_ddp.py: bucketed,
overlapped with backward; then `replicated=False` here reduces the experts only);
`parallel.dense shard` shards it (dense_shard.py: FSDP2), and the functions here then skip or
reduce its DTensor gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from moescale.parallel.all_to_all import collective_errors
from moescale.parallel.dense_shard import DTensor, grad_max, grad_square_sum, scale_grads_
from moescale.parallel.expert_parallel import is_expert_parameter
from moescale.parallel.groups import ParallelGroups


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_expert_parameter(p)]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if not is_expert_parameter(p)]


def ddp_ignore_names(model: nn.Module) -> list[str]:
    """Fully-qualified names of expert parameters, for
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)`."""
    return [name for name, p in model.named_parameters() if is_expert_parameter(p)]


def _average(params: list[nn.Parameter], group, size: int, what: str) -> None:
    """Average `.grad` of params over `group` (missing grads count as zero), coalesced."""
    if size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):
        grads = [p.grad for p in by_dtype[dtype]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        with collective_errors(what, group):
            dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def allreduce_gradients(model: nn.Module, groups: ParallelGroups,
                        replicated: bool = True) -> None:
    """Average replicated grads over the world and expert grads over the shard's DP group.
    Sharded dense parameters (DTensors: parallel.dense shard) are left alone: FSDP
    reduce-scattered their gradients during backward. `replicated=False`: the expert grads
    only (DDP averaged the replicated ones during backward: dense_ddp.py)."""
    if replicated:
        dense = [p for p in replicated_parameters(model) if not isinstance(p, DTensor)]
        _average(dense, groups.world_group, groups.world_size,
                 "replicated-gradient all-reduce")
    _average(expert_parameters(model), groups.dp_group, groups.dp_size,
             "expert-gradient all-reduce")


def global_mean_weight(num_local_tokens: int, groups: ParallelGroups,
                       device=None) -> torch.Tensor:
    """Factor w_r so that the ranks' mean of `w_r * (mean loss over local tokens)` is the mean
    over all tokens of all ranks: w_r = world_size * n_r / N. One all-reduce."""
    if device is None and dist.get_backend(groups.world_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.tensor([float(num_local_tokens)], device=device)
    with collective_errors("token-count all-reduce", groups.world_group):
        dist.all_reduce(total, group=groups.world_group)
    return groups.world_size * num_local_tokens / total.clamp_min(1.0)[0]


def clip_grad_norm_(model: nn.Module, max_norm: float, groups: ParallelGroups,
                    norm_type: float = 2.0, extra_grads=()) -> torch.Tensor:
    """Clip all grads by the global norm (after `allreduce_gradients`); returns the norm.

    Replicated grads are identical on every rank and counted once; the EP group's expert
    shards are disjoint, so their part is summed over the EP group. `extra_grads`: gradients
    outside the model's parameters, disjoint over the EP group like expert shards (dynamic
    placement: the shared store's accumulators of the experts this rank steps); counted and
    scaled (in place) with the expert part.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type!r} is not supported; use 2.0 or math.inf")
    rep = [p.grad for p in replicated_parameters(model) if p.grad is not None]
    exp = [p.grad for p in expert_parameters(model) if p.grad is not None] + list(extra_grads)
    device = next(model.parameters()).device
    inf = norm_type == math.inf
    # plain gradients as they are; sharded dense ones (parallel.dense shard, FSDP2: disjoint
    # over the dense mesh) reduced over it, so every rank gets the whole replicated part
    part = grad_max if inf else grad_square_sum
    rep_part = part(rep, device)
    exp_part = part(exp, device).reshape(1).clone()
    with collective_errors("grad-norm all-reduce", groups.ep_group):
        dist.all_reduce(exp_part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=groups.ep_group)
    if inf:
        total = torch.maximum(rep_part, exp_part[0])
    else:
        total = (rep_part + exp_part[0]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    scale_grads_(rep + exp, coef)
    return total
