"""The dense half sharded with FSDP2 beside expert parallelism (`parallel.dense = "shard"`).

The world of W ranks is a 2-D device mesh (dp, ep) of shape (W / P, P), P the expert-parallel
size, as torchtitan lays it out: a row is an EP group (its ranks hold different experts), a
column a DP group (its ranks hold the same experts). The dense parameters (attention,
embeddings, routers, norms: everything that is not an expert) are replicated on ALL W ranks
when they are not sharded, whatever P is, so they are sharded over all of them: the mesh's two
dimensions flattened into one, `dense` (W ranks). Sharding them over the DP column only would
leave them whole on every rank of an EP run with P = W. docs/scale_out.md has the picture.

`shard_dense(model, mesh)` applies `torch.distributed.fsdp.fully_shard` per transformer block
(`model.blocks`), then to the root, with every expert parameter ignored (`ignored_params`):
the experts stay plain tensors, moved by the exchange and kept by the residency (resident,
host, disk, node store), their gradients reduced as before (`grad_sync.allreduce_gradients`
skips the sharded ones: FSDP reduce-scatters them during backward, averaged over the mesh).
After it, each dense parameter is a DTensor holding its dim-0 shard; the optimizer built on
the model keeps AdamW state only for those shards. On CPU (gloo) each dense linear layer of a
block is a unit of its own, nothing is prefetched and the reduce-scatter keeps no copy
(`_cpu_memory`: what FSDP2's defaults hold there for an overlap CPU cannot have).

`grad_square_sum` / `grad_max` give the dense gradients' part of a global norm with the
sharded gradients reduced over their mesh (one all-reduce for all of them); `shard_like` cuts
a whole tensor into this rank's shard (a checkpoint of format 2, whose dense half was saved
whole, resumed by a sharded run; format 3 goes through torch.distributed.checkpoint, which
reads the shards itself: train/dense_dcp.py).

Legend: W world size, P expert-parallel size.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from moescale.layers.moe import MoE
from moescale.parallel.all_to_all import collective_errors
from moescale.parallel.expert_parallel import is_expert_parameter

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:      # torch < 2.5: no tensor is ever sharded (require_fsdp2 refuses)
    class DTensor:       # type: ignore[no-redef]
        """Stand-in of an older torch: nothing is an instance."""

    distribute_tensor = None


def require_fsdp2() -> None:
    """ValueError unless this torch has FSDP2 with ignored parameters (torch >= 2.7)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        fully_shard = None
    if fully_shard is None or "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ValueError(f"parallel.dense='shard' needs FSDP2 with ignored parameters "
                         f"(torch.distributed.fsdp.fully_shard, torch >= 2.7); this is torch "
                         f"{torch.__version__}: upgrade torch or use parallel.dense replicate")


def dense_mesh(world_size: int, ep_size: int, device_type: str = "cpu"):
    """The 1-D DeviceMesh the dense half is sharded over: the (dp, ep) mesh of the world
    flattened (every rank; see the module docstring). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    require_fsdp2()
    if world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the world of {world_size} ranks")
    mesh_2d = init_device_mesh(device_type, (world_size // ep_size, ep_size),
                               mesh_dim_names=("dp", "ep"))
    return mesh_2d["dp", "ep"]._flatten("dense")


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """Every parameter of an MoE layer's expert container, and every parameter tagged as an
    expert-parallel shard: what FSDP must leave alone."""
    out = {p for p in model.parameters() if is_expert_parameter(p)}
    for moe in model.modules():
        if isinstance(moe, MoE):
            out |= set(moe.experts.parameters())
    return out


def shard_dense(model: nn.Module, mesh) -> None:
    """fully_shard each transformer block, then the root, experts ignored (module docstring).
    The blocks free their gathered parameters after forward (gathered again for backward);
    the root keeps its own (embeddings, final norm, head) until backward, which needs them at
    once. `forward_cached` (generation) gathers like `forward`. On CPU, `_cpu_memory` below."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    ignored = expert_params(model)
    cpu = mesh.device_type == "cpu"
    units = []
    for block in getattr(model, "blocks", ()):
        for linear in _block_linears(block, ignored) if cpu else ():
            fully_shard(linear, mesh=mesh, reshard_after_forward=True)
            units.append(linear)
        fully_shard(block, mesh=mesh, reshard_after_forward=True,
                    ignored_params=ignored & set(block.parameters()))
        units.append(block)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
    units.append(model)
    if cpu:
        _cpu_memory(units)
    if hasattr(model, "forward_cached"):
        register_fsdp_forward_method(model, "forward_cached")


def _block_linears(block: nn.Module, ignored: set[nn.Parameter]) -> list[nn.Module]:
    """The block's dense linear layers (attention's qkv and output projection, a dense FFN's
    matrices), each its own FSDP unit on CPU: a unit is gathered whole (and its gradient
    reduce-scattered whole) through a second buffer of its size, so the transient is twice the
    largest unit's parameters, not twice the block's (`_cpu_memory`)."""
    return [m for m in block.modules() if isinstance(m, nn.Linear)
            and not any(p in ignored for p in m.parameters())]


def _cpu_memory(units: list[nn.Module]) -> None:
    """What FSDP2 holds on CPU (gloo) that it does not need there, measured at d_model 1536 on
    4 ranks (docs/scale_out.md, "Memory per rank"): one block's gathered parameters each.

    - No backward prefetch: by default each unit's backward gathers the next one's parameters
      ahead, to overlap the gather with compute on another CUDA stream; on CPU there is one
      stream, so the prefetch overlaps nothing and only holds a second gathered block. A unit
      told to prefetch itself prefetches nothing (it is gathered already when asked).
    - The reduce-scatter as gloo runs it, without its copies (`_GlooReduceScatter`)."""
    comm = _gloo_reduce_scatter()
    for unit in units:
        unit.set_modules_to_backward_prefetch([unit])
        if comm is not None and hasattr(unit, "set_custom_reduce_scatter"):
            unit.set_custom_reduce_scatter(comm)


def _gloo_reduce_scatter():
    """FSDP's reduce-scatter for gloo: an all-reduce of FSDP's own input buffer in place and
    this rank's chunk copied out, then the buffer's memory released. Gloo's reduce-scatter is
    that same all-reduce, but of a copy of the input (ProcessGroupGloo
    reduce_scatter_tensor_coalesced), and the copy outlives the call until the next collective
    replaces it, while FSDP keeps its input until the next unit's reduce-scatter: two unsharded
    gradient buffers of a block alive after each reduce-scatter instead of none. The same
    all-reduce of the same bytes, so the same result bit for bit. None when this torch has no
    pluggable reduce-scatter (its default is then used)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return None

    class _GlooReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)      # synchronous on gloo
            output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
            input_tensor.untyped_storage().resize_(0)     # FSDP only keeps it alive
            return None

    return _GlooReduceScatter()


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """The local shards of DTensor gradients, and the process group of their mesh (None when
    there is none)."""
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return [], None
    return [g.to_local() for g in sharded], sharded[0].device_mesh.get_group()


def grad_square_sum(grads: list[torch.Tensor], device=None) -> torch.Tensor:
    """Sum of squares (fp32) of `grads`: plain ones as they are, sharded (DTensor) ones summed
    over their mesh, so every rank gets the whole dense part of a global 2-norm."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    local, group = _local(grads)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in plain:
        total = total + g.detach().float().square().sum()
    if group is not None:
        sq = sum(g.detach().float().square().sum() for g in local).reshape(1).to(total.device)
        with collective_errors("dense grad-norm all-reduce", group):
            dist.all_reduce(sq, group=group)
        total = total + sq[0]
    return total


def grad_max(grads: list[torch.Tensor], device=None) -> torch.Tensor:
    """Largest |entry| of `grads` (fp32), sharded ones maxed over their mesh (inf-norm)."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    local, group = _local(grads)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in plain:
        total = torch.maximum(total, g.detach().abs().max().float())
    if group is not None:
        top = torch.stack([g.detach().abs().max().float() if g.numel() else
                           torch.zeros((), device=g.device) for g in local]).max()
        top = top.reshape(1).to(total.device)
        with collective_errors("dense grad-norm all-reduce", group):
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(total, top[0])
    return total


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply gradients in place by `coef` (a sharded one: its local shard)."""
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.dtype))


def shard_like(value: torch.Tensor, like) -> torch.Tensor:
    """`value` (a whole tensor every rank holds) as this rank's shard laid out as `like`
    (a DTensor parameter or state tensor); unchanged when `like` is not sharded. No
    communication: each rank cuts its own shard."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)
