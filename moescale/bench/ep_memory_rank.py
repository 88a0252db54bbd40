"""Rank bodies of `moescale bench ep-memory`: one layer configuration in fresh processes.

`measure_config(rank, world, args, config)` runs on each of W gloo ranks (started by
`run_local` for this configuration alone): glibc is told to return every freed buffer of 64 KiB
or more to the kernel at once (`mallopt` M_MMAP_THRESHOLD / M_TRIM_THRESHOLD, the same as
MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536), so the resident set follows the
live tensors; the layer (dispatcher `config`) runs one warm-up forward + backward; then, with
the layer input already allocated, VmHWM is reset (clear_refs) and one forward + backward of
`y.square().mean()` runs, y not held: peak = VmHWM - VmRSS before it (and its time).

Outputs and gradients of the warm-up step (layer output, input gradient, router gradient, this
rank's expert gradients) are saved by the reference configuration (the unpipelined dispatcher)
into `ref_dir` and compared by every other configuration: max |a - b| / max |b|.

`time_configs(rank, world, args, configs, repeats)` times every configuration in one set of
processes, interleaved round-robin (the memory runs above are one configuration per process
set, one after the other: their times would follow the machine's load, not the strategy).

`auto_choices(rank, world, args, chunks)` asks `PipelinedExpertParallelDispatcher.strategy_for`
(the dispatcher's own decision, measured rates included) what `strategy="auto"` picks.

This file measures one configuration; the sweep, formulas and targets are ep_memory.py's.

Legend: T tokens, D model width.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from pathlib import Path

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
RELEASE_BYTES = 65536


def release_freed_memory() -> bool:
    """Make glibc hand large freed blocks back to the kernel at once (False: not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, RELEASE_BYTES)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, RELEASE_BYTES))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _layer(rank: int, args: dict, config: dict, groups):
    from moescale.layers.moe import MoE
    from moescale.parallel.expert_parallel import shard_moe
    from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

    torch.manual_seed(0)
    full = MoE(args["d_model"], args["experts"], 2, d_ff=args["d_ff"], glu=args["glu"])
    disp = None
    if config["chunks"]:
        disp = PipelinedExpertParallelDispatcher(groups, args["experts"],
                                                 num_chunks=config["chunks"],
                                                 strategy=config["strategy"])
    moe = shard_moe(full, groups, disp)
    del full
    x_TD = torch.randn(args["tokens"], args["d_model"],
                       generator=torch.Generator().manual_seed(1000 + rank))
    return moe, x_TD


def _counts(moe, x_TD: torch.Tensor, num_experts: int) -> dict:
    """Tokens, rows sent and rows received on this rank (one counts exchange)."""
    from moescale.dispatch.plan import build_plan

    with torch.no_grad():
        route = moe.router(x_TD)
        plan = build_plan(route.scores_TK, route.expert_ids_TK, num_experts)
    _, recv_WL = moe.dispatcher.route_counts(plan, x_TD.device)
    return dict(tokens=plan.num_tokens, rows_sent=plan.num_rows,
                rows=int(sum(map(sum, recv_WL))))


def _results(moe, x, y) -> dict[str, torch.Tensor]:
    out = {"output": y.detach(), "input grad": x.grad, "router grad": moe.router.weight.grad}
    for name, p in moe.experts.local.named_parameters():
        out[f"expert grad {name}"] = p.grad
    return out


def _compare(got: dict, ref_path: Path) -> float:
    ref = torch.load(ref_path)
    worst = 0.0
    for name, want in ref.items():
        scale = max(float(want.abs().max()), 1e-30)
        worst = max(worst, float((got[name] - want).abs().max()) / scale)
    return worst


def measure_config(rank: int, world: int, args: dict, config: dict) -> dict:
    from moescale.proc_stats import peak_rss_bytes, reset_peak_rss
    from moescale.parallel.groups import ParallelConfig, build_groups

    released = release_freed_memory()
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    moe, x_TD = _layer(rank, args, config, groups)
    counts = _counts(moe, x_TD, args["experts"])

    def step(x):
        moe(x).square().mean().backward()

    # the warm-up step also gives the outputs and gradients to compare (the measured step
    # must not hold its output: a caller's next layer keeps its own input, not this output)
    warm = x_TD.clone().requires_grad_(True)
    y = moe(warm)
    y.square().mean().backward()
    results = _results(moe, warm, y)
    ref_path = Path(args["ref_dir"]) / f"rank{rank}_{'glu' if args['glu'] else 'ffn'}.pt"
    if config["chunks"] == 0:
        torch.save(results, ref_path)
        error = 0.0
    else:
        error = _compare(results, ref_path)
    del warm, y, results
    moe.zero_grad(set_to_none=True)
    moe.last_aux_loss = None          # its graph would hold the warm-up's input and gradient
    gc.collect()
    x = x_TD.clone().requires_grad_(True)
    torch.distributed.barrier()
    base = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    step(x)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() - base
    return dict(rank=rank, peak_bytes=peak, base_rss_bytes=base, seconds=seconds,
                max_rel_error=error, released_to_os=released, **counts)


def time_configs(rank: int, world: int, args: dict, configs: list[dict], repeats: int) -> dict:
    """Step times of every configuration in one set of processes, interleaved: one warm-up
    round, then `repeats` rounds that each run every configuration once, starting one place
    later each round (same layer and weights, only the dispatcher changes), so that load from
    other processes hits every configuration alike. {label: [seconds per round]}."""
    from moescale.parallel.expert_parallel import ExpertParallelDispatcher
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    moe, x_TD = _layer(rank, args, dict(chunks=0, strategy=None), groups)
    dispatchers = {c["label"]: ExpertParallelDispatcher(groups, args["experts"])
                   if c["chunks"] == 0 else
                   PipelinedExpertParallelDispatcher(groups, args["experts"],
                                                     num_chunks=c["chunks"],
                                                     strategy=c["strategy"])
                   for c in configs}
    times = {c["label"]: [] for c in configs}
    for rnd in range(1 + repeats):
        shift = rnd % len(configs)
        for c in configs[shift:] + configs[:shift]:
            moe.dispatcher = dispatchers[c["label"]]
            moe.zero_grad(set_to_none=True)
            x = x_TD.clone().requires_grad_(True)
            torch.distributed.barrier()
            start = time.perf_counter()
            moe(x).square().mean().backward()
            if rnd:
                times[c["label"]].append(time.perf_counter() - start)
    return times


def auto_choices(rank: int, world: int, args: dict, chunks: list[int]) -> dict:
    """What strategy="auto" picks at each chunk count (with and without the memory limit),
    the cost model's tables, and the measured rates (the same on every rank)."""
    from dataclasses import asdict

    from moescale.parallel.groups import ParallelConfig, build_groups

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    moe, x_TD = _layer(rank, args, dict(chunks=2, strategy="auto"), groups)
    counts = _counts(moe, x_TD, args["experts"])
    tokens = torch.tensor([counts["tokens"], counts["rows_sent"]])
    torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MAX)
    max_tokens, max_rows = tokens.tolist()
    disp, local = moe.dispatcher, moe.experts.local
    picks = {}
    for limit in (None, args.get("memory_limit_bytes")):
        disp.memory_limit_bytes = limit
        for c in chunks:
            key = f"{c}" if limit is None else f"{c} limit"
            try:
                name, table = disp.strategy_for(max_tokens, max_rows, c, local, x_TD)
                picks[key] = dict(strategy=name, table=table)
            except ValueError as exc:      # nothing fits the limit at this chunk count
                picks[key] = dict(strategy=None, table=None, error=str(exc))
    return dict(picks=picks, rates=asdict(disp.rates),
                shape=asdict(disp.layer_shape(max_tokens, max_rows, local, x_TD)))
