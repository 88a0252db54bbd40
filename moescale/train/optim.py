"""The optimizer and the learning-rate schedule of a training run.

`build_optimizer` makes torch's AdamW with two parameter groups: matrices (embeddings, attention,
experts, routers) get weight decay, vectors (norms, biases) do not. `lr_at(step)` is the schedule:
linear warmup from 0 over `warmup_steps`, then cosine or linear decay to `min_lr` at the last
step, or constant. With a sharded dense half (parallel.dense shard) AdamW holds the state of
this rank's shards only. The schedule is a pure function of the step, so a resumed run only needs the
step to continue it exactly (no scheduler object to checkpoint).

Nothing here runs the loop or touches data.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moescale.parallel.dense_shard import DTensor
from moescale.train.config import OptimSection


def decay_groups(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]],
                                             list[tuple[str, nn.Parameter]]]:
    """(name, parameter) pairs with weight decay (matrices) and without (vectors), in the
    order the optimizer numbers them (a checkpoint's `optim.<index>.*`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append((name, p))
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    decay, no_decay = decay_groups(model)
    groups = [{"params": [p for _, p in decay], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in no_decay], "weight_decay": 0.0}]
    # sharded dense parameters (DTensors, parallel.dense shard) beside plain resident experts:
    # torch's foreach kernels take one kind per call, so step them one by one
    kinds = {isinstance(p, DTensor) for _, p in decay + no_decay}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             foreach=len(kinds) < 2)


def lr_at(step: int, cfg: OptimSection, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if cfg.schedule == "constant":
        return cfg.lr if step >= cfg.warmup_steps else cfg.lr * (step + 1) / cfg.warmup_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
