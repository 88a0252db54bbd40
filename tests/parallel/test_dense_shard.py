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
