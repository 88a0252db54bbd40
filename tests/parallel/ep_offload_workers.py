"""Rank functions for tests/parallel/test_expert_parallel_offload.py: an expert-parallel MoE
whose local experts are offloaded (offload_moe on shard_moe's layer) against the
single-process reference, checked on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moescale.offload import OffloadConfig, offload_moe
from moescale.parallel.expert_parallel import shard_moe
from moescale.parallel.groups import ParallelConfig, build_groups
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

from ep_workers import _close, _full_moe, _inputs, _reference, check_layer


def check_offloaded_shards(rank: int, world: int, cases: list[dict], tier: str, directory):
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    done = []
    for i, case in enumerate(cases):
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, world)
        moe = shard_moe(full, groups)
        config = OffloadConfig(tier=tier, device_budget_experts=2, step_mode="deferred",
                               host_cache_bytes=1 << 20 if tier == "disk" else None,
                               directory=f"{directory}/case{i}-rank{rank}" if tier == "disk"
                               else None)
        if tier == "disk":
            import os
            os.makedirs(config.directory)
        engine = offload_moe(moe, config)
        try:
            assert [n for n, _ in moe.named_parameters() if "experts" in n] == []
            check_layer(moe, full, case, xs, cs, y_ref, gx_ref, rank, groups)
            engine.synchronize()
            ids = moe.experts.expert_ids
            for l, e in enumerate(ids):       # store expert l is global expert start + l
                rec = engine.store.acquire((0, l))
                try:
                    grads = engine.store.layouts[0].split(rec.grad_P.clone())
                finally:
                    engine.store.release((0, l))
                for name, got in grads.items():
                    _close(f"expert {e} grad {name}", got, getattr(full.experts, name).grad[e],
                           case)

            def over_ep(sq):
                sq = sq.reshape(1).clone()
                dist.all_reduce(sq, group=groups.ep_group)
                return sq[0]
            norm = engine.clip_grad_norm_(moe.parameters(), 1e-3, reduce_expert_sq=over_ep)
            want = torch.nn.utils.clip_grad_norm_(list(full.parameters()), 1e-3)
            _close("global grad norm", torch.tensor(norm), want, case)
            peak, budget = engine.device.peak_bytes, engine.device.budget_bytes
            assert peak <= budget, (peak, budget)     # also asserted inside the ledger
        finally:
            engine.close()
        done.append((case["name"], peak))
    return done


def refusals(rank: int, world: int):
    """The errors of what offloaded shards cannot do: the planner's tier='auto' (it plans one
    process's experts) and the pipelined strategies that offload the hidden activation."""
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    case = dict(name="refusals", E=2 * world, top_k=2)
    messages = []
    try:
        offload_moe(shard_moe(_full_moe(case), groups),
                    OffloadConfig(tier="auto", tokens_per_micro_batch=16,
                                  device_budget_bytes=1 << 20))
    except ValueError as err:
        messages.append(str(err))
    moe = shard_moe(_full_moe(case), groups,
                    PipelinedExpertParallelDispatcher(groups, case["E"], num_chunks=2,
                                                      strategy="S1"))
    engine = offload_moe(moe, OffloadConfig(tier="host", device_budget_experts=2))
    try:
        moe(torch.randn(5, 8))
    except ValueError as err:
        messages.append(str(err))
    finally:
        engine.close()
    return messages
