"""`moescale bench plan-check`: the planner's predicted step time vs measured, host and disk tier.

For each CPU configuration of a residual MoE stack (fp32, eager, device budget of 3 experts),
`--warmup` (2) + `--runs` (9; `--disk-runs`, 5, for the disk tier) rounds, each of which
1. times this machine's rates once at the configuration's own sizes (`rates.RateProbes`: a
   resident and a streamed MoE layer with the rows an expert gets, an expert's AdamW and copy;
   for the disk tier the store's own direct-I/O path, 1 GiB written and 1 GiB of a file
   written before the store read),
2. then times one real training step (forward, backward, expert and dense optimizer steps)
   and, for the disk tier, counts the bytes the store moved (its counters and the block
   device's, /proc/self/io);
so that rates and steps see the same load. The warm-up rounds are discarded. Reported: the
planner's step time (`planner.estimate(..., tier)`) from the median rates, the median step,
and the error: the median over rounds of (prediction from that round's rates) / (that round's
step) - 1, which a change of load or of the disk's speed between rounds moves least. For the
disk tier also the planner's bytes per step (`planner.disk_traffic`) against the store's (its
counters and the device's, over whole rounds less the probe's own device bytes: the store
writes behind while the next round's probes run).

The disk configuration holds 4.3 GB of expert state with a 1 GiB host cache: with direct I/O
nothing is served from the page cache and the cache is the host memory bound, as past RAM,
only smaller; but on a virtual disk its host's own cache can serve part of a few-GB store's
reads (data written one step before), which a past-RAM store's it cannot, so this row checks
the planner's bytes against a real store more than its time. `--disk-result` adds a row for a real past-RAM run of
`moescale bench offload-disk`: the planner, given that run's configuration and store-path
bandwidths and this machine's other rates measured now at its sizes, against its step.

Targets (issue 11): every error within 25%; two runs of the check within 10% of each other:
per configuration, (1 + error) within 10% of the previous run's (the previous result file, or
`--previous`). The changes of the prediction and of the measurement are reported beside;
they move together when the machine's load or the disk's speed changes. Writes
runs/bench/<time>/plan_check_<hardware>.json with the CPU flags.

Deliberately not here: GPU configurations (the same code with CUDA rates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import COMMITTED, hardware_tag, result_path, write_json
from moescale.bench.offload import MoEStack, training_step
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.planner import Budgets, ModelSpec, disk_traffic, estimate
from moescale.offload.rates import RateProbes, device_io_bytes
from moescale.offload.state_format import StateFormat, parse_formats

GIB = 1 << 30
CONFIGS = {  # name: (tier, layers, d_model, d_ff, experts, tokens)
    "host-d256-e8-t1024": ("host", 2, 256, 1024, 8, 1024),
    "host-d512-e16-t2048": ("host", 2, 512, 2048, 16, 2048),
    # the past-RAM run's expert shape and rows per expert (8), 16 experts a layer: 4.3 GB
    "disk-d1024-e16-t64": ("disk", 2, 1024, 4096, 16, 64),
}


def _config(text: str) -> tuple:
    """A CONFIGS name, or `tier:layers:d_model:d_ff:experts:tokens` (e.g. host:2:32:64:4:64)."""
    if text in CONFIGS:
        return CONFIGS[text]
    tier, *dims = text.split(":")
    if tier not in ("host", "disk") or len(dims) != 5 or not all(d.isdigit() for d in dims):
        raise ValueError(f"--configs entry {text!r} is neither one of {', '.join(CONFIGS)} nor "
                         "tier:layers:d_model:d_ff:experts:tokens with tier host or disk")
    return (tier, *map(int, dims))


def _spec(layers, d_model, d_ff, experts, tokens, fmt: StateFormat = StateFormat()
          ) -> ModelSpec:
    return ModelSpec(moe_layers=layers, d_model=d_model, d_ff=d_ff, num_experts=experts,
                     top_k=2, tokens=tokens, dtype="float32",
                     dense_params=layers * (d_model * experts + 2 * d_model),
                     master=fmt.master, moments=fmt.moments)


def _measure(tier, spec: ModelSpec, budgets: Budgets, args) -> dict:
    """Rates and training steps, interleaved round by round (see the top), and the planner's
    prediction from the median rates and from each round's own rates."""
    runs = args.disk_runs if tier == "disk" else args.runs
    rounds = args.warmup + runs
    # made before the store, so that the disk probe's read file is older than the store's
    probes = RateProbes(disk=tier == "disk", disk_dir=args.dir, rounds=rounds,
                        disk_file_bytes=args.disk_probe_mb << 20, **spec.probe_sizes())
    engine = None
    try:
        torch.manual_seed(0)
        model = MoEStack(spec.moe_layers, spec.d_model, spec.d_ff, spec.num_experts,
                         spec.top_k)
        extra = dict(directory=args.dir, host_cache_bytes=budgets.host_cache_bytes) \
            if tier == "disk" else {}
        engine = offload_moe(model, OffloadConfig(tier=tier, device="cpu", step_mode="eager",
                                                  device_budget_experts=3, master=spec.master,
                                                  moments=spec.moments, **extra))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine.follow(opt)
        x = torch.randn(spec.tokens, spec.d_model)
        store = engine.store
        times, moved, paired = [], [], []
        probe_io = probes.disk.device_bytes if probes.disk is not None else []
        for i in range(rounds):
            # bytes over the whole round: the store writes behind while the next probes run
            counters = (store.bytes_read, store.bytes_written, *device_io_bytes())
            passes = len(probe_io)
            probes.sample()
            start = time.perf_counter()
            training_step(model, x, opt, engine)
            elapsed = time.perf_counter() - start
            after = (store.bytes_read, store.bytes_written, *device_io_bytes())
            if i >= args.warmup:
                times.append(elapsed)
                delta = [b - a for a, b in zip(counters, after)]
                for p in probe_io[passes:]:         # the device bytes less the probe's own
                    delta[2 if p["kind"] == "read" else 3] -= p["device_bytes"]
                moved.append(delta)
                predicted = estimate(spec, budgets, probes.rates_of_round(i), tier).step_s
                paired.append(dict(predicted_s=predicted, measured_s=elapsed))
            print(f"  {'warm-up' if i < args.warmup else 'round'} {i + 1}: step {elapsed:.2f} s"
                  + (f", predicted from this round's rates {paired[-1]['predicted_s']:.2f} s"
                     if i >= args.warmup else ""), flush=True)
        rates = probes.rates(skip=args.warmup)
    finally:
        probes.close()
        if engine is not None:
            engine.close()
    est = estimate(spec, budgets, rates, tier)
    out = dict(predicted_s=est.step_s, measured_s=statistics.median(times), times_s=times,
               parts=est.parts, rates=dataclasses.asdict(rates), rounds=paired,
               paired_error=statistics.median(r["predicted_s"] / r["measured_s"] - 1
                                              for r in paired))
    if tier == "disk":
        names = ("store_read", "store_written", "device_read", "device_written")
        out["bytes_per_step"] = {n: statistics.median(m[k] for m in moved)
                                 for k, n in enumerate(names)}
        out["predicted_bytes_per_step"] = dict(zip(
            ("read", "written"), disk_traffic(spec, budgets.host_cache_bytes)))
    return out


def _disk_result_rows(path: str, args) -> list[dict]:
    """One row per format of a `moescale bench offload-disk` result (older files: one run)."""
    doc = json.loads(Path(path).read_text())
    runs = doc.get("runs") or [doc]
    return [_disk_result_row(path, doc["config"], run, args) for run in runs]


def _disk_result_row(path: str, cfg: dict, res: dict, args) -> dict:
    """The planner against one format's run of a `moescale bench offload-disk` result: that
    run's configuration and disk bandwidths (the store's path, read and write measured
    separately in that run), this machine's other rates measured now at its sizes."""
    fmt = StateFormat(**res["result"]["format_fields"]) if "format_fields" in res["result"] \
        else StateFormat()
    spec = _spec(cfg["layers"], cfg["d_model"], cfg["d_ff"], cfg["experts"], cfg["tokens"], fmt)
    spec.top_k = cfg.get("top_k", 2)
    with RateProbes(disk=False, **spec.probe_sizes()) as probes:
        for _ in range(args.warmup + args.runs):
            probes.sample()
        rates = probes.rates(skip=args.warmup)
    rates = dataclasses.replace(rates, disk_read_bytes_per_s=res["store_read_bytes_per_s"],
                                disk_write_bytes_per_s=res["store_write_bytes_per_s"])
    cache = int(cfg.get("host_cache_gb", 1.0) * GIB)
    est = estimate(spec, Budgets(device_bytes=1 << 50, host_bytes=1 << 50, disk_bytes=1 << 50,
                                 host_cache_bytes=cache), rates, "disk",
                   step_mode=res.get("step_mode", "eager"))
    read, written = disk_traffic(spec, cache, res.get("step_mode", "eager"))
    name = f"past RAM: {Path(path).name}" + ("" if fmt.exact else f" [{fmt.name}]")
    return dict(config=name, tier="disk", predicted_s=est.step_s,
                measured_s=res["step_median_s"], times_s=res.get("step_times_s"),
                parts=est.parts, rates=dataclasses.asdict(rates),
                expert_state_bytes=res["result"]["expert_state_bytes"],
                predicted_bytes_per_step=dict(read=read, written=written),
                bytes_per_step=dict(store_read=res["store_read_bytes_per_step"],
                                    store_written=res["store_write_bytes_per_step"],
                                    device_read=res["device_read_bytes_per_step"],
                                    device_written=res["device_write_bytes_per_step"]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench plan-check", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=9, help="timed rounds (rates + a step) per "
                   "host-tier configuration")
    p.add_argument("--disk-runs", type=int, default=5, help="timed rounds per disk-tier "
                   "configuration (each also moves 2 GiB for the disk probe)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated configurations to predict and measure")
    p.add_argument("--formats", default="fp32+fp32", help="expert state formats to check each "
                   "configuration in, MASTER+MOMENTS comma-separated (e.g. fp32+fp32,bf16+int8)")
    p.add_argument("--dir", default=None, help="where the disk tier's temporary directory "
                   "goes (default: /var/tmp); it is removed at the end")
    p.add_argument("--host-cache-gb", type=float, default=1.0,
                   help="disk tier: host RAM caching expert records, GB")
    p.add_argument("--disk-probe-mb", type=int, default=1024, help="size of the file the "
                   "disk bandwidth is measured on (>= 1024 for a real measurement)")
    p.add_argument("--disk-result", default=None,
                   help="an offload-disk result JSON to compare as the past-RAM row")
    p.add_argument("--previous", default=None, help="a previous plan-check result to compare "
                   "with (default: the output file, if it exists)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: under runs/bench/; a path under "
                        "benchmarks/results updates the recorded result)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        raise ValueError(f"--dir={args.dir!r} is not a directory; give an existing directory "
                         "on the disk to measure (the check makes and removes its own inside)")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(args.out, f"plan_check_{tag}.json")
    previous = Path(args.previous) if args.previous else \
        out if args.out else COMMITTED / f"plan_check_{tag}.json"   # the file it replaces
    before = {r["config"]: r for r in json.loads(previous.read_text())["results"]} \
        if previous.exists() else {}
    cache = int(args.host_cache_gb * GIB)
    budgets = Budgets(device_bytes=1 << 50, host_bytes=1 << 50, disk_bytes=1 << 50,
                      host_cache_bytes=cache)
    rows = []
    # a directory of its own inside --dir, removed at the end: the stores' record files and
    # the disk probe's never stay behind in the user's directory
    with tempfile.TemporaryDirectory(prefix="moescale-plan-", dir=args.dir or "/var/tmp") as tmp:
        args.dir = tmp
        for name, fmt in [(n, f) for n in args.configs.split(",")
                          for f in parse_formats(args.formats)]:
            tier, *shape = _config(name)
            name = name + ("" if fmt.exact else f" [{fmt.name}]")
            print(f"{name}:", flush=True)
            row = dict(config=name, tier=tier)
            row.update(_measure(tier, _spec(*shape, fmt), budgets, args))
            parts = ", ".join(f"{k} {v:.3g}" for k, v in row["parts"].items())
            print(f"  predicted {row['predicted_s']:.2f} s ({parts}), measured "
                  f"{row['measured_s']:.2f} s", flush=True)
            rows.append(row)
    if args.disk_result:
        print(f"{args.disk_result}: rates at its sizes", flush=True)
        rows.extend(_disk_result_rows(args.disk_result, args))
    targets = []
    print(f"\n{'configuration':<44} {'predicted':>10} {'measured':>10} {'error':>8} "
          f"{'vs previous run':>16}")
    for r in rows:
        r["median_error"] = r["predicted_s"] / r["measured_s"] - 1
        r["relative_error"] = err = r.get("paired_error", r["median_error"])
        targets.append(dict(name=f"{r['config']} within 25%", value=err, passed=abs(err) <= 0.25))
        prev = before.get(r["config"])
        change = ""
        if prev is not None:
            ratio_change = (1 + err) / (1 + prev["relative_error"]) - 1
            r["previous_run"] = dict(predicted_change=r["predicted_s"] / prev["predicted_s"] - 1,
                                     measured_change=r["measured_s"] / prev["measured_s"] - 1,
                                     previous_error=prev["relative_error"],
                                     ratio_change=ratio_change)
            targets.append(dict(name=f"{r['config']} predicted/measured within 10% of the "
                                "previous run's", value=ratio_change,
                                passed=abs(ratio_change) <= 0.10))
            change = f"{ratio_change:+.1%}"
        print(f"{r['config']:<44} {r['predicted_s']:9.2f}s {r['measured_s']:9.2f}s {err:+8.1%} "
              f"{change:>16}")
        if "bytes_per_step" in r:
            got, want = r["bytes_per_step"], r["predicted_bytes_per_step"]
            print(f"  disk bytes per step: planner read {want['read'] / GIB:.2f} GiB, written "
                  f"{want['written'] / GIB:.2f} GiB; store read {got['store_read'] / GIB:.2f}, "
                  f"written {got['store_written'] / GIB:.2f}; device read "
                  f"{got['device_read'] / GIB:.2f}, written {got['device_written'] / GIB:.2f}")
    for t in targets:
        print(f"{'PASS' if t['passed'] else 'FAIL'}: {t['name']} ({t['value']:+.1%})")
    write_json(out, dict(benchmark="plan-check", hardware=tag, cpu_flags=cpu_flags(),
                         config={k: v for k, v in vars(args).items() if k != "dir"},
                         results=rows, targets=targets))
    print(f"wrote {out}")
    return 0
