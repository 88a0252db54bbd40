"""Pipelined all-to-all speed on gloo ranks: step time per chunk count and strategy, the online
tuner's choice against the brute-force best, and the overlap efficiency.

For each world size (real processes on this machine), every rank times one MoE layer
forward + backward for every chunk count in {1, 2, 4, 8} and strategy (none, S1-S4), plus the
static (unpipelined) dispatcher, round-robin so that background load hits all alike; each
configuration's time is the median (the minimum is printed too) over repetitions, maximized
over ranks. Then, from the medians (the tuner's estimator too):

  T_comp        the local experts' forward + backward on this rank's received rows, no exchange
  T_comm        the four exchanges of one step (dispatch, combine and their backward) alone
  T_pipe(C)     PipelinedAllToAll alone (strategy none; its combine included), fwd + bwd, C chunks
  overlap(C)  = (T_comm + T_comp - T_pipe(C)) / min(T_comm, T_comp)   (1: comm fully hidden)

and the tuner (num_chunks="auto", candidates 1/2/4/8, `--trials` round-robin trials each after
its warm-up calls) runs from scratch until converged; its pick is compared with the fastest
chunk count of the sweep (target: within 5%, i.e. T_sweep(pick) / T_sweep(best) <= 1.05).

    moescale bench ep-speed [--worlds 2 4] [--tokens 512] [--d-model 128] [--d-ff 512]
        [--experts 8] [--runs 7] [--trials 5] [--out PATH]

Writes runs/bench/<time>/ep_speed_<hardware>.json. Numbers on a shared CPU are noisy; the
file records the configuration and the raw medians. On CPU ranks the "communication" is gloo
copying through loopback TCP on the same cores that compute, so the overlap efficiency says
how much the pipeline's extra messages and smaller GEMMs cost there, not what a GPU gains.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.parallel.launch import run_local

STRATEGIES = ("none", "S1", "S2", "S3", "S4")
CHUNKS = (1, 2, 4, 8)


def _rank_body(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from moescale.dispatch.index import expert_major_order
    from moescale.dispatch.plan import build_plan
    from moescale.layers.moe import MoE
    from moescale.parallel.all_to_all import start_all_to_all
    from moescale.parallel.expert_parallel import shard_moe
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.parallel.pipeline import (PipelinedExpertParallelDispatcher,
                                            run_grouped_pipeline)
    from moescale.parallel.tuner import TunerConfig, bucket_of

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=120))
    torch.manual_seed(0)
    full = MoE(args["d_model"], args["experts"], 2, d_ff=args["d_ff"])
    x = torch.randn(args["tokens"], args["d_model"],
                    generator=torch.Generator().manual_seed(rank))
    items = {"static": shard_moe(full, groups)}
    for chunks in CHUNKS:
        for strategy in STRATEGIES:
            disp = PipelinedExpertParallelDispatcher(groups, args["experts"], num_chunks=chunks,
                                                     strategy=strategy)
            items[f"C{chunks}-{strategy}"] = shard_moe(full, groups, disp)

    def step(moe):
        xin = x.clone().requires_grad_(True)
        moe(xin).square().mean().backward()

    # the pieces: routing of this input, layouts, local counts
    probe = items["C1-none"]
    with torch.no_grad():
        route = probe.router(x)
        plan = build_plan(route.scores_TK, route.expert_ids_TK, args["experts"])
    send, recv, _, _ = probe.dispatcher._exchange(plan, x.device)
    local = probe.experts.local
    _, local_counts = expert_major_order(recv, x.device)
    send_splits, recv_splits = [sum(r) for r in send], [sum(r) for r in recv]

    def comp():
        rows = torch.randn(sum(local_counts), args["d_model"], requires_grad=True)
        local.forward_rows(rows, local_counts).square().mean().backward()

    def comm():
        rows = torch.randn(sum(send_splits), args["d_model"])
        got = start_all_to_all(rows, send_splits, recv_splits, groups.ep_group).wait()
        back = start_all_to_all(got, recv_splits, send_splits, groups.ep_combine_group).wait()
        g = start_all_to_all(back, send_splits, recv_splits, groups.ep_combine_group).wait()
        start_all_to_all(g, recv_splits, send_splits, groups.ep_group).wait()

    def pipe(chunks):
        def run():
            spec = probe.dispatcher.spec(plan, send, recv, chunks, "none")
            xin = x.clone().requires_grad_(True)
            run_grouped_pipeline(xin, plan.scores_R, spec, local).square().mean().backward()
        return run

    timed = {name: (lambda m=moe: step(m)) for name, moe in items.items()}
    timed["T_comp"] = comp
    timed["T_comm"] = comm
    for chunks in CHUNKS:
        timed[f"T_pipe C{chunks}"] = pipe(chunks)
    samples = {name: [] for name in timed}
    for rep in range(2 + args["runs"]):
        for name, fn in timed.items():
            dist.barrier(group=groups.ep_group)
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if rep >= 2:
                samples[name].append(elapsed)
            for p in full.parameters():
                p.grad = None
    names = list(timed)
    stats = torch.tensor([[statistics.median(samples[n]), min(samples[n])] for n in names],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    result = {n: v[0] for n, v in zip(names, stats.tolist())}
    result["min"] = {n: v[1] for n, v in zip(names, stats.tolist())}

    # the online tuner, from scratch
    tuner_config = TunerConfig(candidates=CHUNKS, trials=args["trials"])
    auto = shard_moe(full, groups, PipelinedExpertParallelDispatcher(
        groups, args["experts"], num_chunks="auto", tuner=tuner_config))
    for _ in range(tuner_config.warmup + len(CHUNKS) * tuner_config.trials + 2):
        step(auto)
    tuner = auto.dispatcher.tuner
    bucket = auto.dispatcher.history[-1][0]
    assert tuner.converged(bucket), tuner.samples
    result["tuner"] = dict(bucket=bucket, choice=tuner.best(bucket),
                           history=[c for _, c in auto.dispatcher.history],
                           samples={str(c): v for c, v in tuner.samples[bucket].items()},
                           bucket_from_counts=bucket_of(plan.num_rows))
    for p in full.parameters():
        p.grad = None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moescale bench ep-speed",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4],
                    help="rank counts to time (gloo processes on this machine)")
    ap.add_argument("--tokens", type=int, default=512,
                    help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=128,
                    help="model width")
    ap.add_argument("--d-ff", type=int, default=512,
                    help="expert hidden width")
    ap.add_argument("--experts", type=int, default=8,
                    help="experts in all")
    ap.add_argument("--runs", type=int, default=7, help="timed repetitions of the sweep")
    ap.add_argument("--trials", type=int, default=5, help="tuner measurements per candidate")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: under runs/bench/; a path under "
                         "benchmarks/results updates the recorded result)")
    ns = ap.parse_args(argv)
    args = dict(tokens=ns.tokens, d_model=ns.d_model, d_ff=ns.d_ff, experts=ns.experts,
                runs=ns.runs, trials=ns.trials)
    report = dict(config=args, worlds={}, targets={})
    all_ok = True
    for world in ns.worlds:
        res = run_local(_rank_body, world, (args,), timeout_s=300, deadline_s=1800)[0].value
        print(f"\n== {world} gloo ranks: layer forward+backward, ms (median, max over ranks)")
        print(f"{'chunks':>6} " + " ".join(f"{s:>8}" for s in STRATEGIES))
        for chunks in CHUNKS:
            print(f"{chunks:>6} " + " ".join(f"{1e3 * res[f'C{chunks}-{s}']:>8.1f}"
                                            for s in STRATEGIES))
        print(f"static (unpipelined dispatcher): {1e3 * res['static']:.1f} ms")
        low = res["min"]
        print("minimum over repetitions, ms:")
        for chunks in CHUNKS:
            print(f"{chunks:>6} " + " ".join(f"{1e3 * low[f'C{chunks}-{s}']:>8.1f}"
                                            for s in STRATEGIES))
        t_comp, t_comm = res["T_comp"], res["T_comm"]
        overlap = {c: (t_comm + t_comp - res[f"T_pipe C{c}"]) / min(t_comm, t_comp)
                   for c in CHUNKS}
        print(f"T_comp {1e3 * t_comp:.1f} ms, T_comm {1e3 * t_comm:.1f} ms; "
              + ", ".join(f"T_pipe(C={c}) {1e3 * res[f'T_pipe C{c}']:.1f} ms overlap "
                          f"{overlap[c]:.2f}" for c in CHUNKS))
        sweep = {c: res[f"C{c}-none"] for c in CHUNKS}
        best = min(sweep, key=sweep.get)
        choice = res["tuner"]["choice"]
        ratio = sweep[choice] / sweep[best]
        ok = ratio <= 1.05
        all_ok &= ok
        report["targets"][f"{world} ranks: tuner within 5% of the best"] = ok
        print(f"tuner picked C={choice} ({1e3 * sweep[choice]:.1f} ms in the sweep); brute-force "
              f"best C={best} ({1e3 * sweep[best]:.1f} ms): ratio {ratio:.3f} (target <= 1.05): "
              f"{ok}")
        report["worlds"][str(world)] = dict(times_s=res, overlap_efficiency=overlap,
                                            tuner_choice=choice, brute_force_best=best,
                                            tuner_vs_best=ratio, tuner_within_5pct=ok)
    out = result_path(ns.out, f"ep_speed_{hardware_tag(torch.device('cpu'))}.json")
    write_json(out, report)
    print(f"wrote {out}")
    return 0 if all_ok else 1
