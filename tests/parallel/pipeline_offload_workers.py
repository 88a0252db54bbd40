"""Rank functions for tests/parallel/test_pipelined_offload.py: the pipelined expert-parallel
exchange driving offloaded experts (host and disk tiers) chunk by chunk.

`check_pipelined_offload`: every rank builds the same single-process resident layer, computes
the reference for the whole world's tokens, then runs its own tokens through shard_moe's layer
with a PipelinedExpertParallelDispatcher and offload_moe's containers: output, input gradient,
router gradient and every expert gradient accumulated in the rank's store, within 1e-5 of the
reference relative to its scale (max |value|); the simulated device stays within its budget;
the forward's uploads are all look-ahead uploads but the first (one walk spans the chunks).

`train_pipelined_offload`: a few AdamW steps with 2 micro-batches per step on 2 ranks against
single-process offloaded training of the same global batches (offload_moe on the full layer,
same config): losses and, at the end, every expert master and the router.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from moescale.layers.moe import MoE
from moescale.offload import AdamWConfig, OffloadConfig, offload_moe
from moescale.parallel.expert_parallel import shard_moe
from moescale.parallel.grad_sync import allreduce_gradients
from moescale.parallel.groups import ParallelConfig, build_groups
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

from ep_workers import _full_moe, _inputs, _reference

RTOL = 1e-5


def rel_close(name: str, got, want, case: dict, rtol: float = RTOL) -> float:
    """max |got - want| <= rtol * max |want| (a missing gradient must be all zero)."""
    if got is None or want is None:
        other = got if got is not None else want
        assert other is None or other.numel() == 0 or other.abs().max() == 0, \
            f"{case['name']}: {name} missing"
        return 0.0
    assert got.shape == want.shape, (case["name"], name, got.shape, want.shape)
    if want.numel() == 0:
        return 0.0
    scale = max(want.detach().abs().max().item(), 1e-6)
    err = (got.detach().float() - want.detach().float()).abs().max().item() / scale
    assert err <= rtol, f"{case['name']}: {name} differs by {err:.2e} of its scale"
    return err


def _config(case: dict, tier: str, directory: str, tag: str, **extra) -> OffloadConfig:
    disk = tier == "disk"
    path = f"{directory}/{tag}" if disk else None
    if disk:
        os.makedirs(path)
    options = dict(tier=tier, device_budget_experts=2, step_mode="deferred",
                   host_cache_bytes=1 << 20 if disk else None, directory=path,
                   activation_policy=case.get("policy", "keep"))
    options.update(extra)
    return OffloadConfig(**options)


def _dispatcher(groups, case: dict):
    return PipelinedExpertParallelDispatcher(groups, case["E"], num_chunks=case["chunks"],
                                             strategy=case["strategy"])


def _store_grads(engine, layer: int, l: int) -> dict[str, torch.Tensor]:
    rec = engine.store.acquire((layer, l))
    try:
        return engine.store.layouts[layer].split(rec.grad_P.clone())
    finally:
        engine.store.release((layer, l))


def check_pipelined_offload(rank: int, world: int, cases: list[dict], tier: str,
                            directory: str):
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    done = []
    for i, case in enumerate(cases):
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, world)
        moe = shard_moe(full, groups, _dispatcher(groups, case))
        engine = offload_moe(moe, _config(case, tier, directory, f"case{i}-rank{rank}"))
        worst = 0.0
        try:
            assert [n for n, _ in moe.named_parameters() if "experts" in n] == []
            x = xs[rank].clone().requires_grad_(True)
            y = moe(x)
            stats = moe.dispatcher.last_stats
            assert stats["chunks"] == case["chunks"]
            assert stats["strategy"] in ("none", "S2", "S4", "unpipelined"), stats
            # one upload walk spans the chunks: every upload but the first was issued while
            # an earlier expert (of this chunk or the previous one) computed
            cache = engine.cache
            assert cache.num_lookahead == max(0, cache.num_uploads - 1), \
                (case["name"], cache.num_uploads, cache.num_lookahead)
            worst = max(worst, rel_close("output", y, y_ref[rank], case))
            total = sum(t.shape[0] for t in xs)
            (world * (y * cs[rank]).sum() / total + moe.last_aux_loss).backward()
            allreduce_gradients(moe, groups)
            worst = max(worst, rel_close("input grad", x.grad / world, gx_ref[rank], case))
            worst = max(worst, rel_close("router grad", moe.router.weight.grad,
                                         full.router.weight.grad, case))
            engine.synchronize()
            for l, e in enumerate(moe.experts.expert_ids):
                for name, got in _store_grads(engine, 0, l).items():
                    if case.get("module_experts"):
                        want = full.experts.experts[e].get_parameter(name).grad
                    else:
                        want = getattr(full.experts, name).grad[e]
                    worst = max(worst, rel_close(f"expert {e} grad {name}", got, want, case))
            peak, budget = engine.device.peak_bytes, engine.device.budget_bytes
            assert 0 < peak <= budget, (peak, budget)
        finally:
            engine.close()
        done.append((case["name"], worst, peak, budget))
    return done


def _batches(steps: int, micro: int, world: int, tokens: int, seed: int):
    """[step][micro][rank] -> (x, c)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append([[(torch.randn(tokens, 8, generator=gen), torch.randn(tokens, 8, generator=gen))
                     for _ in range(world)] for _ in range(micro)])
    return out


def _train(moe: MoE, engine, batches, rank: int | None, world: int, groups) -> list[float]:
    """AdamW on the router (dense) and the engine's experts; returns the global losses."""
    opt = torch.optim.AdamW(moe.router.parameters(), lr=1e-2, weight_decay=0.01)
    engine.follow(opt)
    losses = []
    for micro_batches in batches:
        step_loss = 0.0
        for m, per_rank in enumerate(micro_batches):
            engine.begin_micro_batch(last=m == len(micro_batches) - 1)
            total = sum(x.shape[0] for x, _ in per_rank) * len(micro_batches)
            if rank is None:                       # one process: every rank's tokens
                x = torch.cat([x for x, _ in per_rank])
                c = torch.cat([c for _, c in per_rank])
                loss = (moe(x) * c).sum() / total + moe.last_aux_loss / len(micro_batches)
                step_loss += float(loss.detach())
            else:
                x, c = per_rank[rank]
                own = (moe(x) * c).sum() / total
                loss = world * own + moe.last_aux_loss / len(micro_batches)
                both = torch.stack([own.detach(), moe.last_aux_loss.detach()])
                dist.all_reduce(both, group=groups.ep_group)
                step_loss += float(both[0] + both[1] / world / len(micro_batches))
            loss.backward()
        if rank is not None:
            allreduce_gradients(moe, groups)
        engine.step()
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    engine.synchronize()
    return losses


def train_pipelined_offload(rank: int, world: int, cases: list[dict], tier: str,
                            directory: str):
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=30))
    out = []
    for i, case in enumerate(cases):
        full = _full_moe(case)
        batches = _batches(case["steps"], 2, world, case["tokens"], seed=7 + i)
        adam = AdamWConfig(lr=1e-2)
        single = copy.deepcopy(full)
        ref_engine = offload_moe(single, _config(case, "host", directory, "", optimizer=adam,
                                                 step_mode=case["step_mode"]))
        ep = shard_moe(full, groups, _dispatcher(groups, case))
        engine = offload_moe(ep, _config(case, tier, directory, f"train{i}-rank{rank}",
                                         optimizer=adam, step_mode=case["step_mode"]))
        try:
            want = _train(single, ref_engine, batches, None, world, groups)
            got = _train(ep, engine, batches, rank, world, groups)
            errs = [abs(g - w) / abs(w) for g, w in zip(got, want)]
            assert max(errs) <= RTOL, (case["name"], got, want)
            for l, e in enumerate(ep.experts.expert_ids):
                mine, ref = engine.expert_state(0, l), ref_engine.expert_state(0, e)
                for name in ref:
                    rel_close(f"expert {e} master {name}", mine[name], ref[name], case,
                              rtol=case.get("master_rtol", 1e-4))
            rel_close("router", ep.router.weight, single.router.weight, case, rtol=1e-4)
            assert engine.device.peak_bytes <= engine.device.budget_bytes
        finally:
            engine.close()
            ref_engine.close()
        out.append((case["name"], got, max(errs)))
    return out
