"""The sharded dense half (moescale/parallel/dense_shard.py) at the library level.

On 2 gloo ranks, the tiny GPT with its experts split (expert parallelism) and its dense half
sharded with FSDP2 computes, step after step, the single-process model's loss, its global
gradient norm (2-norm and inf-norm: sharded dense gradients reduced over the mesh, expert
gradients over the EP group) and, after clipping, its gradients (gathered whole); the step
guard's dense norm (eager offloading) over the sharded gradients is the whole ones'. The config
refuses an unknown `dense` value with the choices, and a torch whose fully_shard cannot ignore
parameters (torch 2.6's signature, patched in: this torch has it) is refused with the fix.
"""

from __future__ import annotations

import math

import pytest
import torch

from moescale.parallel.groups import ParallelConfig
from moescale.parallel.launch import run_local


def test_an_unknown_dense_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"dense='zero3' is unknown; use one of replicate, "
                                         r"shard"):
        ParallelConfig(dense="zero3")


def test_a_torch_without_fsdp2_ignored_params_is_refused_with_the_fix(monkeypatch):
    import torch.distributed.fsdp as fsdp

    from moescale.parallel.dense_shard import require_fsdp2

    require_fsdp2()                  # this torch has it
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, *, mesh=None: module)  # torch 2.6's
    with pytest.raises(ValueError, match=r"needs FSDP2 with ignored parameters .* upgrade torch "
                                         r"or use parallel.dense replicate"):
        require_fsdp2()


def _clip_worker(rank: int, world: int, norm_type: float):
    import copy

    from torch.distributed.tensor import DTensor

    from moescale.models import gpt_config
    from moescale.models.gpt import GPT
    from moescale.parallel.dense_shard import dense_mesh, shard_dense
    from moescale.parallel.expert_parallel import expert_parallel_model
    from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_
    from moescale.parallel.groups import build_groups
    from moescale.train.guard import dense_grad_norm

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=30))
    torch.manual_seed(0)
    single = GPT(gpt_config("tiny"))
    sharded = expert_parallel_model(copy.deepcopy(single), groups)
    shard_dense(sharded, dense_mesh(world, world))
    assert any(isinstance(p, DTensor) for p in sharded.parameters())
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        data = torch.randint(0, 256, (2 * world, 33), generator=gen)
        idx, tgt = data[:, :-1], data[:, 1:]
        single.zero_grad()
        single(idx, tgt)[1].backward()
        dense_at = [i for i, p in enumerate(sharded.parameters()) if isinstance(p, DTensor)]
        params = list(single.parameters())
        want_dense = dense_grad_norm([params[i] for i in dense_at])   # before the clip
        want = float(torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05,
                                                    norm_type=norm_type))
        sharded.zero_grad()
        mine = slice(rank * 2, rank * 2 + 2)
        sharded(idx[mine], tgt[mine])[1].backward()
        allreduce_gradients(sharded, groups)
        # the step guard's dense norm (eager offloading: no global norm) over the pieces
        got_dense = dense_grad_norm([p for p in sharded.parameters() if isinstance(p, DTensor)])
        got = float(clip_grad_norm_(sharded, 0.05, groups, norm_type=norm_type))
        worst = 0.0
        for (name, p), q in zip(sharded.named_parameters(), single.parameters()):
            if isinstance(p, DTensor):       # dense: the whole clipped gradient
                g = p.grad.full_tensor()
                worst = max(worst, float((g - q.grad).abs().max()))
        out.append((want, got, worst, want_dense, got_dense))
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_global_norm_over_sharded_dense_and_expert_gradients(norm_type):
    for result in run_local(_clip_worker, 2, (norm_type,), timeout_s=30, deadline_s=110):
        for want, got, worst, want_dense, got_dense in result.value:
            assert got == pytest.approx(want, rel=1e-5)
            assert got_dense == pytest.approx(want_dense, rel=1e-5)
            assert want > 0.05 and worst < 1e-7      # the clip was live, the grads agree


def _cpu_memory_worker(rank: int, world: int):
    import copy

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from moescale.models import gpt_config
    from moescale.models.gpt import GPT
    from moescale.parallel import dense_shard
    from moescale.parallel.expert_parallel import expert_parallel_model
    from moescale.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=30))
    torch.manual_seed(0)
    single = GPT(gpt_config("tiny"))
    post_backward, seen = FSDPParamGroup.post_backward, []

    def counting(group, *args):      # gathered units and kept gradient buffers, per unit
        units = [m._get_fsdp_state()._fsdp_param_group for m in group_model.modules()
                 if isinstance(m, FSDPModule) and m is not group_model]
        gathered = [g for g in units if g.is_unsharded or g._all_gather_result is not None]
        out = post_backward(group, *args)
        kept = sum(s.reduce_scatter_input.untyped_storage().nbytes()
                   for s in group.comm_ctx.reduce_scatter_states)
        if group.modules[0] is not group_model:
            seen.append((len(gathered), kept))
        return out

    FSDPParamGroup.post_backward = counting
    data = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(7 + rank))
    result = {}
    for name in ("fsdp defaults", "moescale"):
        group_model = expert_parallel_model(copy.deepcopy(single), groups)
        mesh = dense_shard.dense_mesh(world, world)
        if name == "fsdp defaults":
            orig, dense_shard._cpu_memory = dense_shard._cpu_memory, lambda units: None
            dense_shard.shard_dense(group_model, mesh)
            dense_shard._cpu_memory = orig
        else:
            dense_shard.shard_dense(group_model, mesh)
        seen.clear()
        group_model(data[:, :-1], data[:, 1:])[1].backward()
        grads = [p.grad.to_local().clone() for p in group_model.parameters()
                 if isinstance(p.grad, dense_shard.DTensor)]
        result[name] = (grads, max(n for n, _ in seen), max(k for _, k in seen))
    FSDPParamGroup.post_backward = post_backward
    (want, want_blocks, want_kept), (got, got_blocks, got_kept) = result.values()
    return (all(torch.equal(a, b) for a, b in zip(want, got)) and len(got) == len(want) > 0,
            want_blocks, got_blocks, want_kept, got_kept)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_on_cpu_nothing_is_gathered_ahead_and_no_gradient_buffer_is_kept():
    """FSDP2's defaults gather the next unit ahead in backward (prefetch) and keep each
    reduce-scatter's unsharded input (gloo a copy of it too); on CPU neither is needed
    (`_cpu_memory`): when a unit's backward ends, one unit fewer is gathered than with the
    defaults (the unit itself and the block holding it: its norms), no unsharded gradient
    buffer is left, and the sharded gradients are gloo's own bit for bit."""
    for result in run_local(_cpu_memory_worker, 2, (), timeout_s=60, deadline_s=110):
        same, want_units, got_units, want_kept, got_kept = result.value
        assert same
        assert got_units == want_units - 1 and got_units <= 2
        assert want_kept > 0 and got_kept == 0
