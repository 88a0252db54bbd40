"""`moescale bench placement`: device load balance of static placement, LPT and LPT + split.

Routing drawn from Zipf distributions (exponent 1.0 and 1.5; a fresh random ranking of the 32
experts per draw) over 32 experts on 4 devices, and the router counts of a real training run
(the newest `runs/*/metrics.jsonl` with `tokens_per_expert`, or, when there is none, a tiny GPT
trained here for a few dozen steps; each layer of each step is one sample). Per strategy:
- modelled: max/mean device load in rows (the load model without uploads), the gap between the
  busiest and the idlest device, and the lower bound of max/mean without splitting
  (max(count) * D / total); the slowest device's modelled expert time = its rows x the
  measured seconds per row of one expert (forward + backward) on this machine;
- measured on 4 gloo ranks (optional): the MoE layer's forward + backward under a
  DynamicPlacementDispatcher (wall time from a barrier; the ranks share this machine's cores,
  so it includes contention), and each rank's expert work (the grouped FFN on the experts
  placed on it, forward + backward) replayed alone, rank by rank, timed in thread CPU time
  (robust to the other jobs on a shared box): the slowest rank's expert
  time and max/mean of the measured times, beside the modelled max/mean of the same routing.
- planning time (LPT and LPT + split) for 128 experts on 8 devices, beside the time of sorting
  128 tuples on the same machine (a calibration: this box is shared and loaded).

Writes runs/bench/<time>/placement_<hardware>.json. Not here: GPUs (no device here), the
upload part of the load model (it needs a device cache).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import time

import torch

from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.parallel.placement import Placement, PlacementConfig, plan_placement

STRATEGIES = ("static", "lpt", "lpt+split")


def zipf_counts(rng: random.Random, num_experts: int, exponent: float, rows: int) -> list[int]:
    """Rows per expert drawn from a Zipf law over a random ranking of the experts."""
    weights = [1.0 / (i + 1) ** exponent for i in range(num_experts)]
    rng.shuffle(weights)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids = torch.multinomial(torch.tensor(weights), rows, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=num_experts).tolist()


def static_placement(counts: list[int], num_devices: int) -> Placement:
    """Expert e always on device e * D // E (static expert parallelism)."""
    E = len(counts)
    shards = [(e, e * num_devices // E, 0, n) for e, n in enumerate(counts) if n > 0]
    loads = [0.0] * num_devices
    for e, d, _, n in shards:
        loads[d] += n
    return Placement(shards, loads)


def place(strategy: str, counts: list[int], num_devices: int) -> Placement:
    if strategy == "static":
        return static_placement(counts, num_devices)
    return plan_placement(counts, PlacementConfig(num_devices=num_devices,
                                                  split=strategy == "lpt+split"))


def balance(samples: list[list[int]], num_devices: int, sec_per_row: float) -> dict:
    """Per strategy: mean (and worst) max/mean load, busiest-vs-idlest gaps, modelled time."""
    out = {}
    bounds = [max(1.0, max(c) * num_devices / sum(c)) for c in samples if sum(c)]
    for strategy in STRATEGIES:
        ratios, gaps_mean, gaps_min, slowest, extra = [], [], [], [], []
        for counts in samples:
            if not sum(counts):
                continue
            placement = place(strategy, counts, num_devices)
            loads = placement.device_load
            extra.append(len(placement.raw_shards) - sum(1 for n in counts if n))
            mean = sum(loads) / num_devices
            ratios.append(max(loads) / mean)
            gaps_mean.append((max(loads) - min(loads)) / mean)
            gaps_min.append((max(loads) - min(loads)) / min(loads) if min(loads) else
                            float("inf"))
            slowest.append(max(loads) * sec_per_row)
        out[strategy] = dict(
            max_over_mean=statistics.mean(ratios), max_over_mean_worst=max(ratios),
            gap_over_mean=statistics.mean(gaps_mean),
            gap_over_idlest=statistics.median(gaps_min),
            slowest_device_modelled_s=statistics.mean(slowest),
            extra_shards=statistics.mean(extra))
    out["bound_without_split"] = dict(mean=statistics.mean(bounds), worst=max(bounds))
    return out


def seconds_per_row(d_model: int, d_ff: int, rows: int = 2048, runs: int = 5) -> float:
    """Measured forward + backward seconds of one row through one expert (best of runs)."""
    from moescale.layers.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(1, d_model, d_ff)
    x = torch.randn(rows, d_model, requires_grad=True)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        experts.forward_rows(x, [rows]).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best / rows


def real_run_counts(metrics: str | None, train_steps: int) -> tuple[list[list[int]], str]:
    """Router counts per (step, layer) of a real run, and where they came from."""
    paths = [metrics] if metrics else sorted(glob.glob("runs/*/metrics.jsonl"),
                                             key=os.path.getmtime, reverse=True)
    for path in paths:
        samples = []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                for layer in rec.get("tokens_per_expert") or []:
                    samples.append([int(n) for n in layer])
        if samples:
            return samples, path
        if metrics:
            raise ValueError(f"--metrics {metrics!r} has no tokens_per_expert records; "
                             "give the metrics.jsonl of a moescale training run")
    return _train_tiny(train_steps), f"tiny GPT trained here for {train_steps} steps"


def _train_tiny(steps: int) -> list[list[int]]:
    from moescale.layers.moe import MoE
    from moescale.models import gpt_config
    from moescale.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", seq_len=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 64, (1 << 16,), generator=gen)   # a skewed byte stream
    samples = []
    for _ in range(steps):
        starts = torch.randint(0, text.numel() - 65, (8,), generator=gen)
        batch = torch.stack([text[s:s + 65] for s in starts.tolist()])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        samples += [m.last_stats.routed_E.tolist() for m in model.modules()
                    if isinstance(m, MoE)]
    return samples


def time_planning(runs: int = 9, reps: int = 300) -> dict:
    """Best-of-runs microseconds per plan for 128 experts on 8 devices, with a calibration:
    wall time (`*_us`) and this thread's CPU time (`*_cpu_us`: what planning costs the rank,
    robust to other processes taking the cores of a shared box)."""
    rng = random.Random(0)
    cases = {a: zipf_counts(rng, 128, a, 16384) for a in (1.0, 1.5)}
    tuples = [(-rng.randrange(1000), e, 0, 5) for e in range(128)]
    result = {}

    def best(name: str, fn) -> None:
        for suffix, clock in (("us", time.perf_counter), ("cpu_us", time.thread_time)):
            out = float("inf")
            for _ in range(runs):
                start = clock()
                for _ in range(reps):
                    fn()
                out = min(out, (clock() - start) / reps * 1e6)
            result[f"{name}_{suffix}"] = out

    best("sort_128_tuples", lambda: sorted(tuples))
    for a, counts in cases.items():
        for split in (False, True):
            cfg = PlacementConfig(num_devices=8, split=split)
            best(f"zipf{a}_{'lpt+split' if split else 'lpt'}",
                 lambda cfg=cfg, counts=counts: plan_placement(counts, cfg))
    return result


# ------------------------------------------------------------------ measured on gloo ranks
def _gloo_rank(rank: int, world: int, cfg: dict) -> dict:
    import copy

    import torch.distributed as dist

    from moescale.dispatch.plan import build_plan
    from moescale.layers.experts import GroupedExperts
    from moescale.parallel.dynamic import DynamicPlacementDispatcher

    E, D, F, T, K = cfg["experts"], cfg["d_model"], cfg["d_ff"], cfg["tokens"], cfg["top_k"]
    torch.manual_seed(0)
    base = GroupedExperts(E, D, F)
    out = {}
    for exponent in cfg["exponents"]:
        for strategy in STRATEGIES:
            def hook(placement, counts, strategy=strategy):
                return static_placement(counts, world) if strategy == "static" else placement
            disp = DynamicPlacementDispatcher(
                None, E, PlacementConfig(num_devices=world, split=strategy == "lpt+split"),
                placement_hook=hook)
            experts = copy.deepcopy(base)
            walls, replay, modelled = [], [], []
            for it in range(cfg["iters"]):
                rng = random.Random(1000 * it + int(10 * exponent))   # same ranking everywhere
                weights = [1.0 / (i + 1) ** exponent for i in range(E)]
                rng.shuffle(weights)
                gen = torch.Generator().manual_seed(7919 * rank + it)
                ids = torch.multinomial(torch.tensor(weights).expand(T, E), K, generator=gen)
                scores = torch.full((T, K), 1.0 / K, requires_grad=True)
                plan = build_plan(scores, ids, E)
                x = torch.randn(T, D, generator=gen, requires_grad=True)
                dist.barrier()
                start = time.perf_counter()
                disp(x, plan, experts).sum().backward()
                dist.barrier()
                walls.append(time.perf_counter() - start)
                modelled.append(disp.stats.imbalance)
                counts = disp.last_layout.local_counts_E
                for r in range(world):   # replay each rank's expert work alone
                    if r == rank:
                        replay.append(_replay_experts(experts, counts, cfg["replays"]))
                    dist.barrier()
            out[f"zipf{exponent}/{strategy}"] = dict(wall=walls, replay=replay,
                                                     modelled=statistics.mean(modelled))
    return out


def _replay_experts(experts, counts: list[int], repeats: int) -> float:
    """Thread CPU seconds (best of `repeats`; one torch thread per rank, robust to the other
    jobs on a shared box) of the forward + backward a device does for its placed rows: the
    grouped FFN on the experts with rows here only (as SharedStoreExperts computes them), so
    the experts a device does not hold cost it nothing."""
    from moescale.layers.grouped_ffn import ffn_backward, ffn_forward

    active = [e for e, n in enumerate(counts) if n]
    counts_A = [counts[e] for e in active]
    w = experts.weights().take(torch.tensor(active, dtype=torch.int64))
    w = type(w)(*(None if t is None else t.detach() for t in
                  (w.w1_EDF, w.w2_EFD, w.w3_EDF, w.b1_EF, w.b2_ED)))
    x_RD = torch.randn(sum(counts_A), experts.d_model)
    gy_RD = torch.randn_like(x_RD)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        _, h1_RF, h3_RF = ffn_forward(x_RD, counts_A, w, experts.act)
        ffn_backward(gy_RD, x_RD, h1_RF, h3_RF, counts_A, w, experts.act)
        best = min(best, time.thread_time() - t0)
    return best


def gloo_measure(world: int, cfg: dict) -> dict:
    from moescale.parallel.launch import run_local

    results = run_local(_gloo_rank, world, (cfg,), timeout_s=300, deadline_s=1200)
    per_rank = [r.value for r in results]
    out = {}
    for key in per_rank[0]:
        iters = range(len(per_rank[0][key]["replay"]))
        replay = [[v[key]["replay"][i] for v in per_rank] for i in iters]   # [iter][rank]
        out[key] = dict(
            slowest_rank_layer_step_s=statistics.median(
                max(v[key]["wall"][i] for v in per_rank) for i in iters),
            slowest_rank_expert_s=statistics.median(max(t) for t in replay),
            measured_max_over_mean=statistics.median(max(t) / statistics.mean(t)
                                                     for t in replay),
            modelled_max_over_mean=per_rank[0][key]["modelled"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moescale bench placement",
                                description=__doc__.split("\n")[0])
    p.add_argument("--draws", type=int, default=200, help="Zipf draws per exponent")
    p.add_argument("--rows", type=int, default=16384, help="rows per Zipf draw")
    p.add_argument("--experts", type=int, default=32,
                   help="experts placed")
    p.add_argument("--devices", type=int, default=4,
                   help="devices (ranks) they are placed on")
    p.add_argument("--d-model", type=int, default=256,
                   help="model width of the timed expert work")
    p.add_argument("--d-ff", type=int, default=512,
                   help="expert hidden width of the timed work")
    p.add_argument("--metrics", default=None, help="metrics.jsonl of a run (default: newest "
                   "under runs/, else train a tiny GPT here)")
    p.add_argument("--train-steps", type=int, default=40,
                   help="steps of the tiny GPT trained here when no run's metrics are found")
    p.add_argument("--gloo-iters", type=int, default=5, help="0 skips the gloo measurement")
    p.add_argument("--replays", type=int, default=5,
                   help="replays of each rank's expert work per iteration (best counts)")
    p.add_argument("--gloo-tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--out", default=None,
                   help="JSON path (default: under runs/bench/; a path under "
                        "benchmarks/results updates the recorded result)")
    args = p.parse_args(argv)
    if args.devices < 1 or args.experts < args.devices:
        raise ValueError(f"--experts={args.experts} must be >= --devices={args.devices} >= 1")

    torch.set_num_threads(1)
    sec_row = seconds_per_row(args.d_model, args.d_ff)
    rng = random.Random(0)
    result = dict(experts=args.experts, devices=args.devices, rows_per_draw=args.rows,
                  draws=args.draws, d_model=args.d_model, d_ff=args.d_ff,
                  seconds_per_row_fwd_bwd=sec_row, zipf={})
    for exponent in (1.0, 1.5):
        samples = [zipf_counts(rng, args.experts, exponent, args.rows) for _ in range(args.draws)]
        result["zipf"][str(exponent)] = balance(samples, args.devices, sec_row)
    real, source = real_run_counts(args.metrics, args.train_steps)
    result["real_run"] = dict(source=source, samples=len(real), experts=len(real[0]),
                              **balance(real, args.devices, sec_row))
    result["planning_128_experts_8_devices"] = time_planning()
    if args.gloo_iters > 0:
        result["gloo"] = dict(
            ranks=args.devices, tokens_per_rank=args.gloo_tokens, top_k=2,
            note="top-2 routing (two distinct experts per token) drawn from the Zipf law; "
                 "4 processes share this machine's cores: layer step times include "
                 "contention; expert times are the CPU time of each rank's work (its "
                 "placed experts only) replayed alone (best of --replays); per iteration "
                 "the slowest rank and max/mean over "
                 "ranks, median over iterations; modelled = rows-based max/mean, mean over "
                 "the same iterations",
            **gloo_measure(args.devices, dict(
                experts=args.experts, d_model=args.d_model, d_ff=args.d_ff,
                tokens=args.gloo_tokens, top_k=2, iters=args.gloo_iters, replays=args.replays,
                exponents=(1.0, 1.5))))
    print(json.dumps(result, indent=1))
    out = result_path(args.out, f"placement_{hardware_tag(torch.device('cpu'))}.json")
    write_json(out, result)
    print(f"wrote {out}")
    return 0
