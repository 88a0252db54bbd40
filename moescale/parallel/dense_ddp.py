"""The replicated dense half averaged by DistributedDataParallel instead of one all-reduce.

`parallel.dense replicate` keeps every dense parameter (attention, embeddings, routers, norms)
whole on every rank and averages its gradient over the world after backward:
`grad_sync.allreduce_gradients` does it with one coalesced all-reduce per dtype once backward
has finished. `wrap_dense_ddp` wraps the model in `torch.nn.parallel.DistributedDataParallel`
instead, with every expert parameter on DDP's ignore list (`grad_sync.ddp_ignore_names`):
DDP's reducer all-reduces the dense gradients in buckets of `bucket_cap_mb` as backward
produces them, overlapping the reduction with the rest of backward. The experts' gradients
are left to `allreduce_gradients(model, groups, replicated=False)` (their dp column), as before.

The wrapper is only for forward and backward: checkpoints, clipping and the optimizer keep
using the inner module (`ddp.module`), so no state-dict key gains a `module.` prefix.

Measured against the hand-written all-reduce on CPU/gloo (`moescale bench scale-out`,
docs/scale_out.md "Step time").
"""

from __future__ import annotations

import datetime
import inspect
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moescale.parallel.grad_sync import ddp_ignore_names
from moescale.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class DDPOptions:
    """DDP's knobs that matter for the replicated dense half: torch's defaults but
    `gradient_as_bucket_view`, whose off state keeps the buckets as a second copy of the dense
    gradients for the whole run (+89 MB per rank, 4 bytes per dense parameter, measured on the
    scale-out benchmark's model; with it the peak is the hand-written all-reduce's)."""

    bucket_cap_mb: float = 25.0            # gradient bytes per bucketed all-reduce
    gradient_as_bucket_view: bool = True   # .grad views into the buckets (no second copy)
    static_graph: bool = False             # the same parameters used every iteration

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb!r} must be > 0 (megabytes "
                             "of gradients per bucket; torch's default is 25)")


def wrap_dense_ddp(model: nn.Module, groups: ParallelGroups,
                   options: DDPOptions = DDPOptions()) -> DistributedDataParallel:
    """DDP over `model`'s dense parameters on all ranks, its experts ignored.

    Collective (a process group of its own; DDP checks the parameters' shapes and broadcasts
    rank 0's dense parameters): every rank calls it with the same model layout. The group of
    its own keeps DDP's bucket all-reduces, launched from backward's hooks as gradients become
    ready, out of the sequence of the collectives backward itself makes (the experts'
    all-to-all, dynamic placement's statistics), whose order they need not share on every
    rank. Buffers are not broadcast before each forward (they are built the same everywhere)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ddp_ignore_names(model))
    no_forward_sync = "forward_sync_buffers"    # torch >= 2.13; before: broadcast_buffers
    if no_forward_sync not in inspect.signature(DistributedDataParallel).parameters:
        no_forward_sync = "broadcast_buffers"
    group = dist.new_group(timeout=datetime.timedelta(seconds=groups.timeout_s))
    return DistributedDataParallel(model, process_group=group,
                                   **{no_forward_sync: False},
                                   bucket_cap_mb=options.bucket_cap_mb,
                                   gradient_as_bucket_view=options.gradient_as_bucket_view,
                                   static_graph=options.static_graph)
