"""`moescale bench ep-memory`: the pipelined all-to-all's real per-rank peak memory, per reuse
strategy and chunk count, beside its formula, its step time and what `auto` picks.

For the FFN and the GLU layer (default: the MPipeMoE-scale setting of issue 16: 2 gloo ranks,
d_model 1024, d_ff 4096, 8 experts, 4096 tokens of top-2 per rank, fp32) and for every
configuration (the unpipelined `ExpertParallelDispatcher`; the pipelined dispatcher at 1 chunk
and at each `--chunks` count with each `--strategies` strategy), each rank of a fresh set of
processes (moescale/bench/ep_memory_rank.py) measures:

  peak      VmHWM - VmRSS around one forward + backward of y.square().mean() after a warm-up
            step, with glibc returning every freed block of 64 KiB or more to the kernel;
  formula   moescale.parallel.memory_model's per-rank peak for the same T, R and S;
  error     max |a - b| / max |b| of the output, input, router and expert gradients against
            the unpipelined dispatcher's (the reference configuration, measured first).

Step times come from one more set of processes that holds the layer once and every
configuration's dispatcher: the median over `--repeats` interleaved rounds (each runs every
configuration once; the slowest rank's time), so that the machine's load hits every
configuration alike.

Then, on the same shape, what `strategy="auto"` picks at each chunk count: with the formulas
(the dispatcher's `strategy_for`, its measured rates included) and with the peaks just
measured in place of the formulas (`choose_strategy(peaks=...)`), without a memory limit and
with `--limit` times the unpipelined peak.

Targets (per rank): formula within 10% of the measured peak for every configuration; `none` at
every chunk count from 2 <= 1.0x the unpipelined peak; S4 (the reuse that needs no host
memory: on a CPU host memory is the device memory, so S1/S3 cannot save and S2 saves only the
hidden) at 4 chunks <= 0.60x, at 8 chunks lower still; errors <= 1e-5; every `auto` pick's measured peak at
most the unpipelined one.

    moescale bench ep-memory [--world 2] [--tokens 4096] [--d-model 1024] [--d-ff 4096]
        [--experts 8] [--variants ffn glu] [--chunks 2 4 8] [--strategies none S1 S2 S3 S4]
        [--repeats 3] [--limit 0.6] [--out PATH]

Writes runs/bench/<time>/ep_memory_<hardware>.json (with the CPU's model and flags).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile

import torch

from moescale.bench.ep_memory_rank import auto_choices, measure_config, time_configs
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.parallel.cost_model import Rates, choose_strategy
from moescale.parallel.launch import run_local
from moescale.parallel.memory_model import (LayerShape, pipelined_peak_bytes,
                                            unpipelined_peak_bytes)

MB = 1 << 20


def _cpu() -> dict:
    """The CPU's model name and its full /proc/cpuinfo flags (empty where not readable)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return dict(model=info.get("model name", platform.processor()),
                flags=info.get("flags", "").split())


def _configs(chunks: list[int], strategies: list[str]) -> list[dict]:
    out = [dict(label="unpipelined", chunks=0, strategy=None),
           dict(label="1 chunk none", chunks=1, strategy="none")]
    out += [dict(label=f"{c} chunks {s}", chunks=c, strategy=s)
            for s in strategies for c in chunks if c > 1]
    return out


def _shape(args: dict, rank_row: dict, world: int) -> LayerShape:
    return LayerShape(rows=rank_row["rows"], rows_sent=rank_row["rows_sent"],
                      tokens=rank_row["tokens"], d_model=args["d_model"], d_ff=args["d_ff"],
                      glu=args["glu"], ep_size=world,
                      num_local_experts=args["experts"] // world)


def _formula(shape: LayerShape, config: dict) -> int:
    if config["chunks"] == 0:
        return unpipelined_peak_bytes(shape)
    return pipelined_peak_bytes(shape, config["strategy"], config["chunks"])


def _run_variant(ns, glu: bool, ref_dir: str) -> dict:
    args = dict(tokens=ns.tokens, d_model=ns.d_model, d_ff=ns.d_ff, experts=ns.experts,
                glu=glu, ref_dir=ref_dir)
    rows = []
    configs = _configs(ns.chunks, ns.strategies)
    for config in configs:
        ranks = [r.value for r in run_local(measure_config, ns.world, (args, config),
                                            timeout_s=600, deadline_s=1800)]
        for r in ranks:
            r["formula_bytes"] = _formula(_shape(args, r, ns.world), config)
        rows.append(dict(config, ranks=ranks,
                         max_rel_error=max(r["max_rel_error"] for r in ranks)))
        peaks = ", ".join(f"{r['peak_bytes'] / MB:.0f}" for r in ranks)
        formulas = ", ".join(f"{r['formula_bytes'] / MB:.0f}" for r in ranks)
        print(f"  {config['label']:<18} peak {peaks} MB, formula {formulas} MB", flush=True)
    print(f"  timing {len(configs)} configurations interleaved, {ns.repeats} rounds", flush=True)
    timed = [r.value for r in run_local(time_configs, ns.world, (args, configs, ns.repeats),
                                        timeout_s=600, deadline_s=3600)]
    for row in rows:
        per_round = [max(t[row["label"]][i] for t in timed) for i in range(ns.repeats)]
        row["round_seconds"] = per_round           # the slowest rank's, per round
        row["seconds"] = statistics.median(per_round)
    base = {r["rank"]: r for r in rows[0]["ranks"]}
    for row in rows:
        for r in row["ranks"]:
            r["vs_unpipelined"] = r["peak_bytes"] / max(base[r["rank"]]["peak_bytes"], 1)
            r["formula_vs_measured"] = r["formula_bytes"] / max(r["peak_bytes"], 1)
        row["vs_unpipelined"] = max(r["vs_unpipelined"] for r in row["ranks"])
    limit = ns.limit * max(r["formula_bytes"] for r in base.values())
    auto = run_local(auto_choices, ns.world,
                     (dict(args, memory_limit_bytes=limit), [c for c in ns.chunks]),
                     timeout_s=600, deadline_s=900)[0].value
    auto["memory_limit_bytes"] = limit
    auto["with_measured_peaks"] = _measured_choices(rows, auto, limit, ns.chunks)
    return dict(rows=rows, auto=auto)


def _measured_choices(rows: list[dict], auto: dict, limit: float, chunks: list[int]) -> dict:
    """choose_strategy with this run's measured peaks (the largest rank's) in place of the
    formulas, same rates and shape as the dispatcher's own choice."""
    shape, rates = LayerShape(**auto["shape"]), Rates(**auto["rates"])
    worst = {(row["chunks"], row["strategy"]): max(r["peak_bytes"] for r in row["ranks"])
             for row in rows}
    out = {}
    for c in chunks:
        peaks = {s: v for (cc, s), v in worst.items() if cc == c}
        peaks["unpipelined"] = worst[0, None]
        for key, lim in ((f"{c}", None), (f"{c} limit", limit)):
            try:
                out[key] = choose_strategy(shape, rates, c, lim, peaks=peaks)[0]
            except ValueError as exc:
                out[key] = f"none fits ({exc})"
    return out


def _pick_peak(rows: list[dict], chunks: int, strategy: str) -> list[float] | None:
    """The measured peaks (per rank, x unpipelined) of an auto pick (None: not measured)."""
    key = (0, None) if strategy == "unpipelined" else (chunks, strategy)
    for row in rows:
        if (row["chunks"], row["strategy"]) == key:
            return [r["vs_unpipelined"] for r in row["ranks"]]
    return None


def _targets(name: str, rep: dict, chunks: list[int]) -> dict:
    rows = {(row["chunks"], row["strategy"]): row for row in rep["rows"]}
    t = {}
    t[f"{name}: formula within 10% of the measured peak (every configuration and rank)"] = all(
        abs(r["formula_vs_measured"] - 1) <= 0.10 for row in rep["rows"] for r in row["ranks"])
    t[f"{name}: chunking without reuse (none, 2+ chunks) <= 1.0x unpipelined"] = all(
        row["vs_unpipelined"] <= 1.0 for row in rep["rows"]
        if row["strategy"] == "none" and row["chunks"] > 1)
    if (4, "S4") in rows:
        t[f"{name}: S4 at 4 chunks <= 0.60x unpipelined"] = rows[4, "S4"]["vs_unpipelined"] <= 0.60
    if (4, "S4") in rows and (8, "S4") in rows:
        t[f"{name}: S4 at 8 chunks below 4 chunks"] = \
            rows[8, "S4"]["vs_unpipelined"] < rows[4, "S4"]["vs_unpipelined"]
    t[f"{name}: outputs and gradients within 1e-5 of the unpipelined dispatcher"] = all(
        row["max_rel_error"] <= 1e-5 for row in rep["rows"])
    picks = [(int(k.split()[0]), v["strategy"]) for k, v in rep["auto"]["picks"].items()
             if v["strategy"]] + \
        [(int(k.split()[0]), v) for k, v in rep["auto"]["with_measured_peaks"].items()
         if not v.startswith("none fits")]
    measured = [_pick_peak(rep["rows"], c, s) for c, s in picks]
    t[f"{name}: every auto pick measured <= the unpipelined peak"] = all(
        m is not None and max(m) <= 1.0 for m in measured)
    return t


def _print(name: str, rep: dict) -> None:
    print(f"\n== {name}: per-rank peak (MB), x unpipelined (largest rank), formula / measured, "
          "step time, max rel. error")
    for row in rep["rows"]:
        peaks = "/".join(f"{r['peak_bytes'] / MB:.0f}" for r in row["ranks"])
        form = "/".join(f"{r['formula_vs_measured']:.3f}" for r in row["ranks"])
        print(f"{row['label']:<18} {peaks:>11} {row['vs_unpipelined']:6.3f}x  formula {form}  "
              f"{row['seconds']:6.2f} s  err {row['max_rel_error']:.1e}")
    auto = rep["auto"]
    print("auto (formula):        " + ", ".join(
        f"C={k}: {v['strategy'] or 'none fits'}" for k, v in auto["picks"].items()))
    print("auto (measured peaks): " + ", ".join(
        f"C={k}: {v.split(' (')[0]}" for k, v in auto["with_measured_peaks"].items()))
    print(f"(limit = {auto['memory_limit_bytes'] / MB:.0f} MB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moescale bench ep-memory",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2,
                    help="ranks (gloo processes on this machine)")
    ap.add_argument("--tokens", type=int, default=4096,
                    help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=1024,
                    help="model width")
    ap.add_argument("--d-ff", type=int, default=4096,
                    help="expert hidden width")
    ap.add_argument("--experts", type=int, default=8,
                    help="experts in all")
    ap.add_argument("--variants", nargs="+", choices=("ffn", "glu"), default=["ffn", "glu"],
                    help="expert kinds measured: ffn, glu")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8],
                    help="chunk counts of the pipelined all-to-all")
    ap.add_argument("--strategies", nargs="+", default=["none", "S1", "S2", "S3", "S4"],
                    choices=("none", "S1", "S2", "S3", "S4"),
                    help="memory-reuse strategies (none, S1-S4)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved timing rounds (after one warm-up round)")
    ap.add_argument("--limit", type=float, default=0.6,
                    help="memory limit for auto, times the unpipelined peak")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: under runs/bench/; a path under "
                         "benchmarks/results updates the recorded result)")
    ns = ap.parse_args(argv)
    report = dict(config=dict(world=ns.world, tokens=ns.tokens, d_model=ns.d_model,
                              d_ff=ns.d_ff, experts=ns.experts, top_k=2, dtype="float32",
                              repeats=ns.repeats, limit=ns.limit, threads_per_rank=1),
                  hardware=dict(tag=hardware_tag(torch.device("cpu")), cpu=_cpu(),
                                torch=torch.__version__),
                  variants={}, targets={})
    with tempfile.TemporaryDirectory(prefix="ep_memory_ref_") as ref_dir:
        for variant in ns.variants:
            print(f"{variant}:", flush=True)
            rep = _run_variant(ns, variant == "glu", ref_dir)
            report["variants"][variant] = rep
            report["targets"].update(_targets(variant, rep, ns.chunks))
            _print(variant, rep)
    print()
    for name, ok in report["targets"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    out = result_path(ns.out, f"ep_memory_{report['hardware']['tag']}.json")
    write_json(out, report)
    print(f"wrote {out}")
    return 0 if all(report["targets"].values()) else 1
