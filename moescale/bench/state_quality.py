"""`moescale bench state-quality`: compact expert state judged by loss curves against fp32.

Trains the default model (`moescale train`, the tiny MoE GPT on the built-in corpus) with its
experts on the host tier, once per expert state format and seed, each run a separate
`moescale train` process (`--offload.tier host --offload.master M --offload.moments V
--train.seed S`, one thread each so that parallel lanes do not slow each other's math), and
compares the final validation losses: each format's mean over seeds against fp32 state's, with
the seed-to-seed spread of fp32 beside it (a lossy format is judged against the noise of the
exact one). Runs already complete in the output folder are reused (a run directory holds its
metrics), so an interrupted comparison continues.

Writes runs/bench/<time>/state_quality_<hardware>_<steps>.json or --out (per run the
validation curve, final validation loss, train loss of the last 20 steps, wall time; per format
the mean and the difference to fp32 in %) and a PNG of the validation curves (fp32 solid,
compact dashed).

Deliberately not here: the formats themselves (offload/state_format.py), the disk tier's bytes
(bench offload-disk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import hardware_tag, result_path, write_json

DEFAULT_FORMATS = "fp32+fp32,bf16+int8,fp32+int8,bf16+bf16,fp32+bf16,bf16+fp32"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench state-quality",
                                description=__doc__.split("\n")[0])
    p.add_argument("--formats", default=DEFAULT_FORMATS, help="MASTER+MOMENTS entries, "
                   "comma-separated; the first is the reference (fp32+fp32)")
    p.add_argument("--seeds", default="1234,1235", help="train.seed of each run")
    p.add_argument("--steps", type=int, default=500, help="train.steps of every run")
    p.add_argument("--lanes", type=int, default=2, help="runs at once (one thread each)")
    p.add_argument("--runs-dir", default="runs/state-quality", help="where the run "
                   "directories go (complete runs there are reused)")
    p.add_argument("--extra", default="", help="more `moescale train` options, one string")
    p.add_argument("--out", default=None, help="the JSON (default: runs/bench/<time>/"
                   "state_quality_<hardware>_<steps>.json); the plot beside it")
    return p


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _complete(run_dir: Path, steps: int) -> bool:
    return any(r.get("kind") == "val" and r.get("step") == steps for r in _records(run_dir))


def _run(args, fmt: str, seed: int) -> dict:
    master, moments = fmt.split("+")
    run_dir = Path(args.runs_dir) / f"{master}-{moments}-s{seed}-n{args.steps}"
    wall = None
    if not _complete(run_dir, args.steps):
        cmd = [sys.executable, "-m", "moescale", "train", "--offload.tier", "host",
               "--offload.master", master, "--offload.moments", moments, "--train.seed",
               str(seed), "--train.steps", str(args.steps), "--train.threads", "1",
               "--train.progress", "false", "--train.report", "false",
               "--train.sample_tokens", "0", "--train.run_dir", str(run_dir),
               *args.extra.split()]
        if run_dir.exists():
            cmd = [sys.executable, "-m", "moescale", "train", "--resume", str(run_dir)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()[-400:]}")
    recs = _records(run_dir)
    vals = [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "val"]
    curve = [r["loss"] for r in recs if r.get("kind") == "train"]
    train = curve[-20:]
    print(f"  {fmt} seed {seed}: val {vals[-1][1]:.4f}", flush=True)
    return dict(format=fmt, seed=seed, run_dir=str(run_dir), val_curve=vals, train_curve=curve,
                final_val_loss=vals[-1][1], train_loss_last20=sum(train) / len(train),
                wall_s=wall)


def _plot(runs: list[dict], path: Path, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 5))
    colors = {}
    for r in runs:
        color = colors.setdefault(r["format"], f"C{len(colors)}")
        style = dict(color=color, linestyle="-" if r["format"] == runs[0]["format"] else "--",
                     label=f"{r['format']} seed {r['seed']}")
        losses = r["train_curve"]
        window = 25
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(losses))]
        ax_train.plot(range(1, len(smooth) + 1), smooth, linewidth=0.9, **style)
        steps_, vals = zip(*r["val_curve"])
        ax_val.plot(steps_, vals, marker="o", markersize=3, **style)
    ax_train.set_ylim(top=min(3.0, ax_train.get_ylim()[1]))
    ax_train.set_title(f"training loss (mean of the last 25 steps), {steps} steps")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.set_ylabel("nats/byte")
        ax.grid(alpha=0.3)
    ax_val.legend(fontsize=7)
    fig.suptitle("expert state formats: the default model, experts on the host tier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",")]
    for f in formats:
        if f.count("+") != 1:
            print(f"moescale bench state-quality: --formats entry {f!r} is not MASTER+MOMENTS",
                  file=sys.stderr)
            return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 1 or args.lanes < 1:
        print("moescale bench state-quality: --steps and --lanes must be >= 1", file=sys.stderr)
        return 2
    os.makedirs(args.runs_dir, exist_ok=True)
    jobs = [(f, s) for f in formats for s in seeds]
    with ThreadPoolExecutor(args.lanes) as pool:
        runs = list(pool.map(lambda job: _run(args, *job), jobs))
    ref = [r["final_val_loss"] for r in runs if r["format"] == formats[0]]
    ref_mean = statistics.mean(ref)
    summary = {}
    print(f"\n{'format':<12} {'val loss per seed':<24} {'mean':>8} {'vs ' + formats[0]:>14}")
    for f in formats:
        vals = [r["final_val_loss"] for r in runs if r["format"] == f]
        mean = statistics.mean(vals)
        summary[f] = dict(final_val_losses=vals, mean=mean,
                          vs_reference_pct=100 * (mean / ref_mean - 1))
        print(f"{f:<12} {', '.join(f'{v:.4f}' for v in vals):<24} {mean:>8.4f} "
              f"{summary[f]['vs_reference_pct']:>+13.2f}%")
    spread = 100 * (max(ref) - min(ref)) / ref_mean if len(ref) > 1 else None
    if spread is not None:
        print(f"seed-to-seed spread of {formats[0]}: {spread:.2f}% (max - min over the mean)")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(args.out, f"state_quality_{tag}_{args.steps}.json")
    write_json(out, dict(benchmark="state-quality", hardware=tag, cpu_flags=cpu_flags(),
                         config=vars(args), runs=runs, summary=summary,
                         reference_seed_spread_pct=spread))
    _plot(runs, out.with_suffix(".png"), args.steps)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
