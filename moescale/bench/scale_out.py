"""The sharded dense half (parallel.dense shard, FSDP2) against the replicated one: memory per
rank at N = 2 and 4 ranks, step time on 2.

A GPT whose dense half (attention, embeddings, routers, norms) is `--d-model` wide and
`--layers` deep (default: 88 MB of fp32 dense parameters), its experts split over all N ranks
(expert parallelism), trained with AdamW (moescale.train.optim) on gloo ranks of this machine.

Memory: fresh processes per (N, mode), each mode as `moescale train` runs it (replicated: the
dense gradients averaged by DDP, parallel/dense_ddp.py; sharded: FSDP2), `--mem-steps` steps
each; per rank, the bytes of the
dense parameters it holds (its shards when sharded) and of their AdamW state (exp_avg,
exp_avg_sq), and the peak resident set (VmHWM) twice: over the whole process (which includes
building the whole model before it is sharded: every rank builds the same initial weights)
and over the training steps only (VmHWM reset after the build), glibc told to return freed
blocks of 64 KiB or more at once so that the resident set follows the live tensors; "RSS
growth" is the steps' peak less the process's RSS before the model existed (torch, gloo),
which holds the unsharded rest too (this rank's resident experts with their gradients and
AdamW state, activations, DDP's buckets). The target: dense bytes
sharded <= (1/N + 10%) of replicated.

Step time: 2 ranks holding three copies of the model, a sharded, a replicated and a DDP one,
stepped in turn (`--runs` interleaved repetitions after `--warmup`, the order rotated, a
barrier before each, a sample is the slower rank's time); the ratios sharded / replicated,
ddp / replicated and sharded / ddp (the trainer's replicated mode) are the geometric means of
the paired ratios with their 95% t-intervals.
One step = forward + backward of `--batch` sequences of `--seq` tokens per rank, the gradient
sync (replicated: the coalesced all-reduce after backward; sharded: FSDP's reduce-scatter
during backward; ddp: DDP's bucketed all-reduce during backward, parallel/dense_ddp.py, with
`--ddp-bucket-mb`, `--[no-]ddp-grad-view`, `--ddp-static-graph` as its knobs; the defaults
are the trainer's, dense_ddp.DDPOptions), global-norm
clipping and the AdamW step. `--ranks ''` measures the step time only.

    moescale bench scale-out [--d-model 768] [--layers 8] [--vocab 4096] [--d-ff 64] [--batch 2]
        [--seq 64] [--ranks 2,4] [--mem-steps 3] [--runs 15] [--warmup 2] [--out PATH]
        [--ddp-bucket-mb 25] [--no-ddp-grad-view] [--ddp-static-graph]

`--runs 0` measures the memory only (no step time: "step_time" null in the JSON).

Writes runs/bench/<time>/scale_out_<hardware>.json (or --out) with the CPU flags and the
load average before and after: on a shared 2-core machine both modes' ranks share the cores
and the exchanges are loopback copies, so the step times are noisy (the interval says how).
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

MODES = ("replicate", "shard")
# memory: each dense mode as `moescale train` runs it (replicated: averaged by DDP)
TRAINER_MODE = {"replicate": "ddp", "shard": "shard"}
STEP_MODES = MODES + ("ddp",)     # step time: the hand-written all-reduce as the baseline too


def _model(args: dict, groups, mode: str):
    """The bench's GPT on this rank: experts split over the world, dense half per `mode`."""
    from moescale.models.gpt import GPT, GPTConfig
    from moescale.parallel.dense_shard import dense_mesh, shard_dense
    from moescale.parallel.expert_parallel import expert_parallel_model
    from moescale.train.config import OptimSection
    from moescale.train.optim import build_optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_flat(vocab_size=args["vocab"], seq_len=args["seq"],
                                    n_layers=args["layers"], d_model=args["d_model"],
                                    n_heads=args["d_model"] // 64, d_ff=args["d_ff"],
                                    num_experts=2 * groups.world_size, top_k=2))
    expert_parallel_model(model, groups)
    if mode == "shard":
        shard_dense(model, dense_mesh(groups.world_size, groups.ep_size))
    optimizer = build_optimizer(model, OptimSection())
    if mode == "ddp":    # forward and backward through the wrapper; the rest on the model
        return _ddp(model, groups, args), optimizer
    return model, optimizer


def _ddp(model, groups, args: dict):
    from moescale.parallel.dense_ddp import DDPOptions, wrap_dense_ddp

    return wrap_dense_ddp(model, groups, DDPOptions(
        bucket_cap_mb=args.get("ddp_bucket_mb", 25.0),
        gradient_as_bucket_view=args.get("ddp_grad_view", True),
        static_graph=args.get("ddp_static_graph", False)))


def _step(model, optimizer, groups, idx_BS, tgt_BS) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_

    optimizer.zero_grad(set_to_none=True)
    model(idx_BS, tgt_BS)[1].backward()
    if isinstance(model, DistributedDataParallel):   # DDP averaged the dense grads already
        model = model.module
        allreduce_gradients(model, groups, replicated=False)
    else:
        allreduce_gradients(model, groups)
    clip_grad_norm_(model, 1.0, groups)
    optimizer.step()


def _batch(args: dict, rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _dense_bytes(model, optimizer) -> tuple[int, int]:
    """(bytes of the dense parameters this rank holds, bytes of their AdamW state)."""
    from torch.distributed.tensor import DTensor

    from moescale.parallel.dense_shard import expert_params

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    experts = {id(p) for p in expert_params(model)}
    params = state = 0
    for p in model.parameters():
        if id(p) in experts:
            continue
        params += local(p).numel() * p.element_size()
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state += local(value).numel() * value.element_size()
    return params, state


def _memory_rank(rank: int, world: int, args: dict, mode: str) -> dict:
    from moescale.bench.ep_memory_rank import release_freed_memory, rss_bytes
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.proc_stats import peak_rss_bytes, reset_peak_rss

    released = release_freed_memory()     # the resident set follows the live tensors
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    torch.set_num_threads(1)
    before = rss_bytes()
    model, optimizer = _model(args, groups, TRAINER_MODE[mode])
    build_peak = peak_rss_bytes()
    reset_peak_rss()
    for step in range(args["mem_steps"]):
        _step(model, optimizer, groups, *_batch(args, rank, step))
    params, state = _dense_bytes(model, optimizer)
    return dict(rank=rank, dense_param_bytes=params, dense_adamw_bytes=state,
                dense_bytes=params + state, rss_before_model_bytes=before,
                rss_after_steps_bytes=rss_bytes(), glibc_releases_freed_blocks=released,
                process_peak_rss_bytes=max(build_peak, peak_rss_bytes()),
                steps_peak_rss_bytes=peak_rss_bytes())


def _time_rank(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from moescale.parallel.groups import ParallelConfig, build_groups

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    torch.set_num_threads(1)
    models = {mode: _model(args, groups, mode) for mode in STEP_MODES}
    samples = {mode: [] for mode in STEP_MODES}
    for rep in range(args["warmup"] + args["runs"]):
        shift = rep % len(STEP_MODES)    # each mode in each position of the round alike
        for mode in STEP_MODES[shift:] + STEP_MODES[:shift]:
            dist.barrier()
            start = time.perf_counter()
            _step(*models[mode], groups, *_batch(args, rank, rep))
            if rep >= args["warmup"]:
                samples[mode].append(time.perf_counter() - start)
    times = torch.tensor([samples[m] for m in STEP_MODES], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {m: row for m, row in zip(STEP_MODES, times.tolist())}


def _growth(rank: dict) -> int:
    """The peak resident set of the training steps above the process's before the model."""
    return rank["steps_peak_rss_bytes"] - rank["rss_before_model_bytes"]


def _memory(args: dict, ranks: list[int]) -> list[dict]:
    rows = []
    print(f"{'N':>2} {'mode':<9} {'dense MB/rank':>14} {'x replicated':>12} {'target':>7} "
          f"{'RSS growth MB':>14} {'x repl.':>8} {'steps peak MB':>14} {'process peak MB':>16}")
    for n in ranks:
        per_mode = {}
        for mode in MODES:
            results = run_local(_memory_rank, n, (args, mode), timeout_s=600, deadline_s=1800)
            per_mode[mode] = [r.value for r in results]
        rep = max(r["dense_bytes"] for r in per_mode["replicate"])
        rep_growth = max(_growth(r) for r in per_mode["replicate"])
        for mode in MODES:
            worst = max(per_mode[mode], key=lambda r: r["dense_bytes"])
            ratio = worst["dense_bytes"] / rep
            target = 1.0 if mode == "replicate" else 1.0 / n + 0.10
            growth = max(_growth(r) for r in per_mode[mode])
            steps_peak = max(r["steps_peak_rss_bytes"] for r in per_mode[mode])
            process_peak = max(r["process_peak_rss_bytes"] for r in per_mode[mode])
            print(f"{n:>2} {mode:<9} {worst['dense_bytes'] / 1e6:>14.1f} {ratio:>12.3f} "
                  f"{target:>7.2f} {growth / 1e6:>14.1f} {growth / rep_growth:>8.3f} "
                  f"{steps_peak / 1e6:>14.1f} {process_peak / 1e6:>16.1f}")
            rows.append(dict(ranks=n, mode=mode, dense_bytes_max_rank=worst["dense_bytes"],
                             ratio_to_replicated=ratio, target_ratio=target,
                             within_target=ratio <= target + 1e-12,
                             rss_growth_max_rank=growth,
                             rss_growth_ratio_to_replicated=growth / rep_growth,
                             per_rank=per_mode[mode]))
    return rows


def _write(out: str | None, name: str, args: dict, memory: list[dict], load_before,
           step_time: dict | None) -> int:
    """The JSON (`step_time` None: `--runs 0`, the memory only); exit code 1 when the dense
    bytes miss their target."""
    ok = all(r["within_target"] for r in memory)
    if memory:
        print(f"dense bytes per rank within 1/N + 10% of replicated at every N: {ok}")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(out, f"{name}_{tag}.json")
    write_json(out, dict(benchmark="scale-out", hardware=tag, cpu_flags=cpu_flags(),
                         load_average_1_5_15min=dict(before=load_before,
                                                     after=os.getloadavg()),
                         config=args, torch_threads_per_rank=1, memory=memory,
                         step_time=step_time, dense_within_target=ok if memory else None))
    print(f"wrote {out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moescale bench scale-out",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=768, help="model width (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (tied embedding)")
    ap.add_argument("--d-ff", type=int, default=64,
                    help="expert hidden width (small: the resident set is mostly the dense half)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--ranks", default="2,4",
                    help="world sizes of the memory measurement ('': step time only)")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps per memory measurement")
    ap.add_argument("--runs", type=int, default=15,
                    help="timed interleaved repetitions (0: the memory only)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    ap.add_argument("--ddp-bucket-mb", type=float, default=25.0,
                    help="step time's ddp mode: DDP's bucket_cap_mb")
    ap.add_argument("--ddp-grad-view", action=argparse.BooleanOptionalAction, default=True,
                    help="step time's ddp mode: DDP's gradient_as_bucket_view (the trainer's)")
    ap.add_argument("--ddp-static-graph", action="store_true",
                    help="step time's ddp mode: DDP's static_graph")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: under runs/bench/; a path under "
                         "benchmarks/results updates the recorded result)")
    ns = ap.parse_args(argv)
    wrong = [text for bad, text in (
        (ns.d_model % 64, f"--d-model={ns.d_model} must be a multiple of 64 (heads of 64)"),
        (ns.runs == 1 or ns.runs < 0,
         f"--runs={ns.runs} must be >= 2 (the interval needs pairs) or 0 (memory only)"),
        (ns.mem_steps < 1, f"--mem-steps={ns.mem_steps} must be >= 1"),
        (not ns.ddp_bucket_mb > 0, f"--ddp-bucket-mb={ns.ddp_bucket_mb} must be > 0"),
        (ns.runs == 0 and not ns.ranks.strip(",").strip(),
         "--runs 0 with --ranks '' measures nothing: give world sizes or runs")) if bad]
    if wrong:
        raise ValueError("; ".join(wrong))
    ranks = [int(n) for n in ns.ranks.split(",") if n]
    args = dict(d_model=ns.d_model, layers=ns.layers, vocab=ns.vocab, d_ff=ns.d_ff,
                batch=ns.batch, seq=ns.seq, mem_steps=ns.mem_steps, runs=ns.runs,
                warmup=ns.warmup, ddp_bucket_mb=ns.ddp_bucket_mb, ddp_grad_view=ns.ddp_grad_view,
                ddp_static_graph=ns.ddp_static_graph)
    load_before = os.getloadavg()   # the machine is shared: how busy it was
    memory = _memory(args, ranks) if ranks else []
    if not ns.runs:
        return _write(ns.out, "scale_out_memory", args, memory, load_before, None)
    load_timing = os.getloadavg()
    times = run_local(_time_rank, 2, (args,), timeout_s=600, deadline_s=3000)[0].value
    ratios = {f"{a}_to_{b}": paired_ratio(times[a], times[b])
              for a, b in (("shard", "replicate"), ("ddp", "replicate"), ("shard", "ddp"))}
    medians = {m: statistics.median(t) for m, t in times.items()}
    print(f"step time on 2 ranks: hand-written all-reduce {1e3 * medians['replicate']:.1f} ms, "
          f"ddp {1e3 * medians['ddp']:.1f} ms, sharded {1e3 * medians['shard']:.1f} ms "
          f"(medians of {ns.runs}); " + "; ".join(f"{k.replace('_to_', ' / ')} {r}"
                                                  for k, r in ratios.items()))
    print(f"load average (1, 5, 15 min) before the step times {load_timing}, after "
          f"{os.getloadavg()}")
    return _write(ns.out, "scale_out", args, memory, load_before, dict(
        ranks=2, times_s=times, median_s=medians,
        **{f"ratio_{k}": r.as_dict() for k, r in ratios.items()},
        load_average_before=load_timing,
        interval="95% t-interval of the paired per-repetition log-ratios (geometric mean)"))
