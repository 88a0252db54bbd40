"""Pipelined expert parallelism with host-tier experts: step time and device peak per rank.

On 2 gloo ranks (real processes on this machine), one MoE layer whose local experts live in
each rank's host-tier store (`offload_moe`, simulated device with a budget of `--budget`
experts), timed behind the unpipelined exchange (`ExpertParallelDispatcher`, the offloaded
path before issue 12) and behind the pipelined all-to-all at each chunk count and strategy
(the offloaded containers driven chunk by chunk: uploads of chunk k+1's experts overlapped
with chunk k's compute and with the exchanges). One step = forward + backward of the layer,
the experts' eager AdamW steps on the host and `engine.synchronize()`.

Interleaved: every repetition runs every configuration once, round-robin, the start rotated
per repetition, a barrier before each; a sample is the slower rank's time. Reported per
configuration: median, and the ratio to the unpipelined path as the geometric mean of the
paired per-repetition ratios with its 95% t-interval; per rank: the simulated device peak
against its budget (it must not exceed it), the uploads, the look-ahead uploads and the walk
positions served by a retained copy instead of an upload (cache.py, retention). A
configuration `C<chunks>-<strategy>-noreuse` runs with the snake order and retention off
(every expert uploaded once per chunk: the pipelined path before them), interleaved too.
`Cauto-<strategy>` lets the online tuner pick the chunk count (1, 2, 4 or 8; it explores in
its first 14 calls, so give --warmup 16 or more); the pick is recorded per rank (`chunks`).

    moescale bench ep-offload [--tokens 1024] [--d-model 256] [--d-ff 1024] [--experts 8]
        [--budget 2] [--configs C2-none,C4-none,C2-S2,C4-S4[,C2-none-noreuse]] [--runs 9]
        [--out PATH]

Writes runs/bench/<time>/ep_offload_<hardware>.json with the CPU flags and the load average
before and after (other processes on the cores widen the intervals). On CPU ranks the
exchanges are gloo copies through loopback TCP on the cores that compute, and an "upload" is
a memory copy: what the pipeline hides here is little; a GPU is the real test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.bench.stats import paired_ratio
from moescale.parallel.launch import run_local


def _rank_body(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from moescale.layers.moe import MoE
    from moescale.offload import OffloadConfig, offload_moe
    from moescale.parallel.expert_parallel import shard_moe
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=300))
    torch.manual_seed(0)
    full = MoE(args["d_model"], args["experts"], 2, d_ff=args["d_ff"])
    x = torch.randn(args["tokens"], args["d_model"],
                    generator=torch.Generator().manual_seed(rank))
    names = ["unpipelined"] + args["configs"]
    layers, engines = {}, {}
    for name in names:
        dispatcher = None
        if name != "unpipelined":
            chunks, strategy = name[1:].split("-")[:2]
            dispatcher = PipelinedExpertParallelDispatcher(
                groups, args["experts"], strategy=strategy,
                num_chunks=chunks if chunks == "auto" else int(chunks))
        moe = shard_moe(full, groups, dispatcher)
        engines[name] = offload_moe(moe, OffloadConfig(
            tier="host", device_budget_experts=args["budget"], step_mode="eager"))
        if name.endswith("-noreuse"):
            engines[name].cache.retain = engines[name].snake = False
        layers[name] = moe

    def step(name: str) -> None:
        xin = x.clone().requires_grad_(True)
        layers[name](xin).square().mean().backward()
        engines[name].step()
        engines[name].synchronize()

    samples = {name: [] for name in names}
    for rep in range(args["warmup"] + args["runs"]):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier(group=groups.ep_group)
            start = time.perf_counter()
            step(name)
            if rep >= args["warmup"]:
                samples[name].append(time.perf_counter() - start)
    times = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=groups.ep_group)
    out = {"times_s": {n: row for n, row in zip(names, times.tolist())}, "rank": {}}
    for name in names:
        dev, cache = engines[name].device, engines[name].cache
        out["rank"][name] = dict(device_peak_bytes=dev.peak_bytes,
                                 device_budget_bytes=dev.budget_bytes,
                                 uploads=cache.num_uploads, lookahead_uploads=cache.num_lookahead,
                                 reused=cache.num_reused,
                                 strategy=layers[name].dispatcher.last_stats.get("strategy")
                                 if name != "unpipelined" else None,
                                 chunks=layers[name].dispatcher.last_stats.get("chunks")
                                 if name != "unpipelined" else None)
        engines[name].close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moescale bench ep-offload",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=256,
                    help="model width")
    ap.add_argument("--d-ff", type=int, default=1024,
                    help="expert hidden width")
    ap.add_argument("--experts", type=int, default=8,
                    help="experts in all")
    ap.add_argument("--budget", type=float, default=2.0, help="device budget in experts")
    ap.add_argument("--configs", default="C2-none,C4-none,C2-S2,C4-S4",
                    help="pipelined configurations C<chunks|auto>-<strategy>[-noreuse]")
    ap.add_argument("--runs", type=int, default=9, help="timed repetitions")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed repetitions first")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: under runs/bench/; a path under "
                         "benchmarks/results updates the recorded result)")
    ns = ap.parse_args(argv)
    if ns.runs < 2 or ns.warmup < 0:      # before any rank starts: the interval needs pairs
        raise ValueError(f"--runs={ns.runs} must be >= 2 (the confidence interval needs pairs) "
                         f"and --warmup={ns.warmup} >= 0")
    args = dict(tokens=ns.tokens, d_model=ns.d_model, d_ff=ns.d_ff, experts=ns.experts,
                budget=ns.budget, configs=[c for c in ns.configs.split(",") if c],
                runs=ns.runs, warmup=ns.warmup)
    for c in args["configs"]:
        parts = c[1:].split("-")
        if not c.startswith("C") or len(parts) not in (2, 3) or \
                not (parts[0].isdigit() or parts[0] == "auto") or \
                parts[2:] not in ([], ["noreuse"]):
            raise ValueError(f"--configs entry {c!r} must look like C<chunks|auto>-<strategy>"
                             "[-noreuse], e.g. C4-S4 or C2-none-noreuse")
    world = 2
    load_before = os.getloadavg()   # the machine is shared: how busy it was
    results = run_local(_rank_body, world, (args,), timeout_s=300, deadline_s=3000)
    times = results[0].value["times_s"]
    base = times["unpipelined"]
    rows, ok = [], True
    print(f"\n{'configuration':<16} {'median ms':>10} {'x unpipelined [95% CI]':>30} "
          f"{'device peak / budget per rank (KiB)':>38}")
    for name, t in times.items():
        ranks = [r.value["rank"][name] for r in results]
        within = all(r["device_peak_bytes"] <= r["device_budget_bytes"] for r in ranks)
        ok &= within
        interval = None if name == "unpipelined" else paired_ratio(t, base)
        shown = "1 (reference)" if interval is None else str(interval).split(" (")[0]
        peaks = ", ".join(f"{r['device_peak_bytes'] >> 10} / {r['device_budget_bytes'] >> 10}"
                          for r in ranks)
        picked = f"  (tuner: {ranks[0]['chunks']} chunks)" if name.startswith("Cauto") else ""
        print(f"{name:<16} {1e3 * statistics.median(t):>10.1f} {shown:>30} {peaks:>38}{picked}")
        rows.append(dict(name=name, median_s=statistics.median(t), times_s=t,
                         ratio=None if interval is None else interval.as_dict(),
                         ranks=ranks, peak_within_budget=within))
    print(f"device peak within budget on every rank: {ok}")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(ns.out, f"ep_offload_{tag}.json")
    write_json(out, dict(benchmark="ep-offload", hardware=tag, cpu_flags=cpu_flags(),
                         load_average_1_5_15min=dict(before=load_before,
                                                     after=os.getloadavg()),
                         world=world, config=args, torch_threads_per_rank=1,
                         interval="95% t-interval of the paired per-repetition log-ratios "
                                  "to the unpipelined offloaded path (geometric mean)",
                         results=rows, peaks_within_budget=ok))
    print(f"wrote {out}")
    return 0 if ok else 1
