"""Rank bodies for the expert-parallel tests (run under moescale.parallel.launch.run_local).

Every rank builds the same full single-process MoE from the same seed, generates every rank's
tokens from the same seeds, and computes the single-process reference for the whole world
locally (the ReferenceMoE sharing the full layer's parameters). It then runs its own tokens
through the expert-parallel layer, back-propagates its share of the loss, synchronizes the
gradients, and compares its output, its input gradient, the replicated (router) gradient and
its expert shard's gradients against the reference. No gathering: each rank checks itself.

Loss convention under test: L = (sum over all tokens of all ranks of <y_t, c_t>) / N + aux,
where each rank back-propagates W * (its sum) / N + its aux (the ranks' mean is L).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from moescale.layers.moe import MoE
from moescale.layers.reference import ReferenceMoE
from moescale.parallel.expert_parallel import shard_moe
from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_
from moescale.parallel.groups import ParallelConfig, build_groups
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

D, F = 8, 12
ATOL, RTOL = 2e-5, 1e-4


def _full_moe(case: dict) -> MoE:
    torch.manual_seed(1234)
    experts = None
    if case.get("module_experts"):
        experts = [nn.Sequential(nn.Linear(D, F), nn.Tanh(), nn.Linear(F, D))
                   for _ in range(case["E"])]
    moe = MoE(D, case["E"], case["top_k"], d_ff=F, router="topk", glu=case.get("glu", False),
              bias=case.get("bias", False), capacity_factor=case.get("capacity"),
              aux_loss_coef=0.05, experts=experts)
    dead = case.get("dead", ())
    with torch.no_grad():
        for e in dead:            # x[:, 0] is large and positive: these never win top-k
            moe.router.weight[e, 0] = -20.0
        for e in range(case["E"]):
            if e not in dead:
                moe.router.weight[e, 0] = 0.0
    return moe


def _inputs(case: dict, world: int):
    gen = torch.Generator().manual_seed(99)
    xs, cs = [], []
    for r in range(world):
        n = case["tokens"][r]
        x = torch.randn(n, D, generator=gen)
        x[:, 0] = 3.0 + x[:, 0].abs()
        xs.append(x)
        cs.append(torch.randn(n, D, generator=gen))
    return xs, cs


def _reference(case, full: MoE, xs, cs, ep_size: int):
    """Outputs, input grads and parameter grads of the reference loss (on full's params)."""
    ref = ReferenceMoE(full)
    world = len(xs)
    total = max(sum(x.shape[0] for x in xs), 1)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    loss, ys = 0.0, []
    for x, c in zip(leaves, cs):
        if x.shape[0] == 0:
            ys.append(x.new_zeros(0, D))
            continue
        y = ref(x)
        ys.append(y)
        loss = loss + (y * c).sum() / total
    num_dp = world // ep_size
    for g in range(num_dp):       # balance statistics are reduced over each EP group
        x_g = torch.cat(leaves[g * ep_size:(g + 1) * ep_size])
        ref(x_g)
        loss = loss + ref.last_aux_loss / num_dp
    full.zero_grad(set_to_none=True)
    loss.backward()
    return [y.detach() for y in ys], [x.grad for x in leaves], ref


def _close(name, got, want, case):
    if got is None or want is None:
        if got is None and want is None:
            return
        if (got if got is not None else want).abs().max() == 0:
            return
        raise AssertionError(f"{case['name']}: {name}: one gradient is missing")
    if got.shape != want.shape or not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{case['name']}: {name} differs from the reference "
                             f"(max abs err {err}, shapes {tuple(got.shape)} vs "
                             f"{tuple(want.shape)})")


def check_layer(moe, full, case, xs, cs, y_ref, gx_ref, rank, groups) -> None:
    """This rank's output, then backward of its share of the loss and gradient averaging:
    its input gradient and the router gradient against the reference."""
    world = len(xs)
    x = xs[rank].clone().requires_grad_(True)
    y = moe(x)
    _close("output", y.detach(), y_ref[rank], case)
    total = max(sum(t.shape[0] for t in xs), 1)
    loss = world * (y * cs[rank]).sum() / total + moe.last_aux_loss
    loss.backward()
    allreduce_gradients(moe, groups)
    # activation grads are those of this rank's own loss: W times dL/dx
    _close("input grad", x.grad / world, gx_ref[rank], case)
    _close("router grad", moe.router.weight.grad, full.router.weight.grad, case)


def check_against_reference(rank: int, world: int, cases: list[dict], ep_size: int | None):
    groups = build_groups(ParallelConfig(ep_size=ep_size, backend="gloo", timeout_s=20))
    done = []
    for case in cases:
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, groups.ep_size)
        dispatcher = None
        if "chunks" in case:
            dispatcher = PipelinedExpertParallelDispatcher(
                groups, case["E"], num_chunks=case["chunks"], strategy=case["strategy"],
                memory_limit_bytes=case.get("memory_limit"))
        moe = shard_moe(full, groups, dispatcher)
        check_layer(moe, full, case, xs, cs, y_ref, gx_ref, rank, groups)
        ids = moe.experts.expert_ids
        for name, p in moe.experts.local.named_parameters():
            if case.get("module_experts"):
                idx, rest = name.split(".", 2)[1], name.split(".", 2)[2]
                want = full.experts.experts[ids.start + int(idx)].get_parameter(rest).grad
            else:
                full_grad = getattr(full.experts, name).grad
                want = None if full_grad is None else full_grad[ids.start:ids.stop]
            _close(f"expert grad {name}", p.grad, want, case)
        if case.get("clip"):
            norm = clip_grad_norm_(moe, 1e-3, groups)
            want = torch.nn.utils.clip_grad_norm_(list(full.parameters()), 1e-3)
            _close("global grad norm", norm, want, case)
        if case.get("strategy") == "auto":
            assert moe.dispatcher.last_stats["strategy"] in case["allowed"], \
                moe.dispatcher.last_stats
        done.append(case["name"])
    return done


def die_or_dispatch(rank: int, world: int, mode: str, timeout_s: float):
    """Rank 1 dies (or stalls) before the layer's first exchange; the others must fail."""
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=timeout_s))
    case = dict(E=2 * world, top_k=2)
    moe = shard_moe(_full_moe(case), groups)
    torch.distributed.barrier()
    if rank == 1:
        if mode == "die":
            os._exit(7)
        time.sleep(timeout_s * 1.5 + 1)
        return "stalled"
    x = torch.randn(5, D)
    start = time.time()
    try:
        moe(x)
    except RuntimeError as exc:
        return ("raised", str(exc), time.time() - start)
    return ("no error", "", time.time() - start)


def check_primitives(rank: int, world: int):
    """torchrun-style init from the environment, the autograd all-to-all (sync and async),
    the counts exchange, and the user errors of the dispatchers."""
    from moescale.parallel.all_to_all import (all_to_all_rows, all_to_all_rows_async,
                                              exchange_counts)
    from moescale.parallel.expert_parallel import ExpertParallelDispatcher
    from moescale.parallel.grad_sync import global_mean_weight
    from moescale.parallel.groups import init_distributed

    groups = init_distributed(ParallelConfig(backend="gloo", timeout_s=20))
    assert (groups.rank, groups.world_size, groups.ep_size, groups.dp_size) == \
        (rank, world, world, 1)

    def rows(src, dst):           # uneven, some zero
        return (src + 2 * dst) % 3

    send = [rows(rank, p) for p in range(world)]
    recv = [rows(s, rank) for s in range(world)]
    x = torch.cat([torch.full((send[p], 2), 10.0 * rank + p) for p in range(world)])
    for use_async in (False, True):
        leaf = x.clone().requires_grad_(True)
        if use_async:
            out, handle = all_to_all_rows_async(leaf, send, recv, grad_scale=0.5)
            out = handle.wait()
        else:
            out = all_to_all_rows(leaf, send, recv, grad_scale=0.5)
        want = torch.cat([torch.full((recv[s], 2), 10.0 * s + rank) for s in range(world)])
        assert torch.equal(out, want), (out, want)
        (out * (out + 1)).sum().backward()     # d/dout = 2 out + 1, sent back, times 0.5
        assert torch.equal(leaf.grad, 0.5 * (2 * x + 1)), leaf.grad
    counts = torch.tensor([[rows(rank, p), 7 * rank + p] for p in range(world)])
    got = exchange_counts(counts).tolist()
    assert got == [[rows(s, rank), 7 * s + rank] for s in range(world)], got
    weight = global_mean_weight(rank + 1, groups)
    total = world * (world + 1) / 2
    assert abs(weight.item() - world * (rank + 1) / total) < 1e-6
    errors = []
    try:
        ExpertParallelDispatcher(groups, 2 * world + 1)
    except ValueError as exc:
        errors.append(str(exc))
    case = dict(E=2 * world, top_k=1, module_experts=True)
    moe = shard_moe(_full_moe(case), groups,
                    PipelinedExpertParallelDispatcher(groups, 2 * world, num_chunks=2,
                                                      strategy="S1"))
    try:
        moe(torch.randn(3, D))
    except ValueError as exc:
        errors.append(str(exc))
    try:                          # a full expert set under an EP dispatcher is refused
        MoE(D, 2 * world, 2, d_ff=F,
            dispatcher=ExpertParallelDispatcher(groups, 2 * world))(torch.randn(3, D))
    except ValueError as exc:
        errors.append(str(exc))
    _check_schedule(rank, groups)
    return errors


def _check_schedule(rank, groups, chunks=4):
    """The pipeline issues chunk k+1's exchange before chunk k's experts run (both ways),
    one exchange per chunk and direction, and the chunks cover the rows without padding."""
    from moescale.dispatch.plan import build_plan
    from moescale.parallel.pipeline import run_grouped_pipeline

    world = groups.ep_size
    case = dict(E=2 * world, top_k=2)
    moe = shard_moe(_full_moe(case), groups, PipelinedExpertParallelDispatcher(groups, 2 * world))
    x = torch.randn(9 + rank, D, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        route = moe.router(x)
        plan = build_plan(route.scores_TK, route.expert_ids_TK, 2 * world)
    send, recv, _, _ = moe.dispatcher._exchange(plan, x.device)
    spec = moe.dispatcher.spec(plan, send, recv, chunks, "S4")
    spec.trace = []
    layouts = spec.layouts
    assert sum(sum(lay.send_splits) for lay in layouts) == plan.num_rows
    assert sum(lay.num_recv for lay in layouts) == sum(map(sum, recv))
    assert sorted(torch.cat([lay.row_idx for lay in layouts]).tolist()) == \
        list(range(plan.num_rows))
    xin = x.clone().requires_grad_(True)
    run_grouped_pipeline(xin, plan.scores_R, spec, moe.experts.local).sum().backward()
    at = {event: i for i, event in enumerate(spec.trace)}
    for event in ("pipelined dispatch", "pipelined combine", "output grads",
                  "pipelined backward (re-dispatch)", "input grads"):
        assert sum(e == event for e, _ in spec.trace) == chunks, (event, spec.trace)
    for k in range(chunks - 1):
        assert at["pipelined dispatch", k + 1] < at["experts forward", k]
        assert at["pipelined combine", k] < at["experts forward", k + 1]
        assert at["output grads", k + 1] < at["experts backward", k]
        assert at["pipelined backward (re-dispatch)", k + 1] < at["experts backward", k]
        assert at["experts backward", k] < at["input grads", k] < at["experts backward", k + 1]


def check_tuner(rank: int, world: int, steps: int):
    """The online tuner: same choices on every rank, uneven token counts, output unchanged."""
    from moescale.parallel.tuner import TunerConfig

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    case = dict(E=2 * world, top_k=2)
    full = _full_moe(case)
    tuned = shard_moe(full, groups, PipelinedExpertParallelDispatcher(
        groups, case["E"], num_chunks="auto", strategy="auto",
        tuner=TunerConfig(candidates=(1, 2, 4), trials=1, warmup=0)))
    static = shard_moe(full, groups)
    gen = torch.Generator().manual_seed(rank)
    strategies = []
    for step in range(steps):
        x = torch.randn(5 + 3 * rank + step % 2, D, generator=gen)
        y = tuned(x.requires_grad_(True))
        y.sum().backward()
        _close("tuned output", y.detach(), static(x).detach(), dict(name=f"step {step}"))
        stats = tuned.dispatcher.last_stats
        chosen = [row for row in stats["strategy_table"] if row["strategy"] == stats["strategy"]]
        assert chosen[0]["fits"] and chosen[0]["peak_bytes"] <= chosen[0]["unpipelined_bytes"]
        strategies.append(stats["strategy"])
    rates = tuned.dispatcher.rates
    assert rates is not None and rates.gemm_flops > 0 and rates.a2a_bytes_per_s > 0
    return tuned.dispatcher.history, tuned.dispatcher.tuner.samples, strategies


def train_gpt(rank: int, world: int, steps: int, pipelined: bool):
    """The default (tiny) GPT trained on W ranks with expert parallelism and on one process
    with the full batch: the losses (ranks' mean) and clipped grad norms agree step by step."""
    import copy

    from moescale.models import gpt_config
    from moescale.models.gpt import GPT
    from moescale.parallel.expert_parallel import expert_parallel_model

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=30))
    torch.manual_seed(0)
    single = GPT(gpt_config("tiny"))
    factory = (lambda moe: PipelinedExpertParallelDispatcher(
        groups, moe.num_experts, num_chunks=3, strategy="S4")) if pipelined else None
    ep = expert_parallel_model(copy.deepcopy(single), groups, factory)
    # SGD: Adam's first steps are sign-like, so fp32 rounding in near-zero gradient entries
    # (1e-8 absolute, present between any two summation orders) would move weights by up to
    # lr and flip routing decisions; the gradients themselves agree to fp32 rounding.
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-4)
            for m in (single, ep)]
    gen = torch.Generator().manual_seed(7)
    batch, seq = 2 * world, 32
    losses = []
    for _ in range(steps):
        data = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        idx, tgt = data[:, :-1], data[:, 1:]
        _, loss_single = single(idx, tgt)
        opts[0].zero_grad()
        loss_single.backward()
        norm_single = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.5)
        opts[0].step()
        mine = slice(rank * batch // world, (rank + 1) * batch // world)
        _, loss_ep = ep(idx[mine], tgt[mine])
        opts[1].zero_grad()
        loss_ep.backward()
        allreduce_gradients(ep, groups)
        norm_ep = clip_grad_norm_(ep, 0.5, groups)
        opts[1].step()
        mean_loss = loss_ep.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append((loss_single.item(), mean_loss.item() / world, norm_single.item(),
                       norm_ep.item()))
    # the gathered EP weights are the single-process weights; and they load back
    from moescale.parallel.state import full_state_dict, load_full_state_dict

    gathered, want = full_state_dict(ep, groups), single.state_dict()
    assert gathered.keys() == want.keys(), set(gathered) ^ set(want)
    for key, value in want.items():
        _close(f"state {key}", gathered[key], value, dict(name="train"))
    fresh = expert_parallel_model(copy.deepcopy(GPT(gpt_config("tiny"))), groups, factory)
    load_full_state_dict(fresh, want, groups)
    idx = torch.randint(0, 256, (1, 16), generator=gen)
    _close("reloaded logits", fresh(idx)[0].detach(), single(idx)[0].detach(),
           dict(name="train"))
    return losses


def check_ddp_and_builders(rank: int, world: int):
    """DDP skipping the tagged experts; setup_expert_parallel; expert_parallel_moe;
    groups_from; bf16 autocast through the exchange."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from moescale.parallel.expert_parallel import ExpertParallelDispatcher, expert_parallel_moe
    from moescale.parallel.grad_sync import ddp_ignore_names, expert_parameters
    from moescale.parallel.groups import groups_from
    from moescale.parallel.setup import setup_expert_parallel

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    # DDP averages the replicated grads and leaves the experts alone
    case = dict(name="ddp", E=2 * world, top_k=2, tokens=[7, 3, 5, 4][:world])
    full = _full_moe(case)
    xs, cs = _inputs(case, world)
    y_ref, gx_ref, _ = _reference(case, full, xs, cs, world)
    ep = shard_moe(full, groups)
    names = ddp_ignore_names(ep)
    assert names and all(".local." in n for n in names), names
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ep, names)
    ddp = DistributedDataParallel(ep)
    x = xs[rank].clone().requires_grad_(True)
    y = ddp(x)
    total = sum(t.shape[0] for t in xs)
    (world * (y * cs[rank]).sum() / total + ep.last_aux_loss).backward()
    _close("ddp output", y.detach(), y_ref[rank], case)
    _close("ddp router grad", ep.router.weight.grad, full.router.weight.grad, case)
    ids = ep.experts.expert_ids
    _close("ddp expert grad", ep.experts.local.w1_EDF.grad,
           full.experts.w1_EDF.grad[ids.start:ids.stop], case)

    # one call for a whole model: pipelined dispatchers from the config
    torch.manual_seed(5)
    model = nn.Sequential(MoE(D, 2 * world, 2, d_ff=F), nn.Tanh(), MoE(D, 2 * world, 1, d_ff=F))
    single = copy.deepcopy(model)
    setup_expert_parallel(model, ParallelConfig(backend="gloo", timeout_s=20, chunks=2,
                                                reuse="S2"))
    assert type(model[0].dispatcher).__name__ == "PipelinedExpertParallelDispatcher"
    assert len(expert_parameters(model)) == 4
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
    _close("setup output", model(x).detach(), single(x).detach(), dict(name="setup"))

    # built from scratch with the total number of experts
    moe = expert_parallel_moe(groups, D, 2 * world, 2, d_ff=F, glu=True)
    assert moe.experts.num_local_experts == 2 and moe.num_experts == 2 * world
    assert all(getattr(p, "moescale_expert", False) for p in moe.experts.parameters())
    moe(torch.randn(4, D)).sum().backward()

    from moescale.parallel.state import full_state_dict, load_full_state_dict

    mods = _full_moe(dict(E=2 * world, top_k=2, module_experts=True))
    shard = shard_moe(mods, groups)
    gathered = full_state_dict(shard, groups)
    assert gathered.keys() == mods.state_dict().keys()
    assert all(torch.equal(gathered[k], v) for k, v in mods.state_dict().items())
    with torch.no_grad():
        for p in shard.parameters():
            p.add_(1.0)
    load_full_state_dict(shard, mods.state_dict(), groups)
    assert all(torch.equal(full_state_dict(shard, groups)[k], v)
               for k, v in mods.state_dict().items())

    described = groups_from(None)
    assert (described.ep_size, described.ep_rank, described.dp_size) == (world, rank, 1)
    assert described.ep_ranks == list(range(world))

    # bf16 autocast: rows travel in bf16, results match the single-process layer
    for disp in (ExpertParallelDispatcher(groups, full.num_experts),
                 PipelinedExpertParallelDispatcher(groups, full.num_experts, num_chunks=2,
                                                   strategy="S3")):
        ep2 = shard_moe(full, groups, disp)
        x = xs[rank].clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ep = ep2(x).float()
            y_single = full(xs[rank]).float()
        err = (y_ep - y_single).abs().max().item()
        assert err <= 4e-2 * max(y_single.abs().max().item(), 1e-6), (type(disp), err)
        y_ep.sum().backward()
        assert x.grad.dtype == torch.float32 and ep2.experts.local.w1_EDF.grad is not None
    return True
