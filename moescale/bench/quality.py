"""Quality at equal compute: the MoE GPT against a dense GPT with the same ACTIVE parameters.

`moescale bench quality [--seconds 120] [--size tiny] ...` (or `python benchmarks/quality.py`)
trains two models on the built-in corpus (the Python standard library's source, byte tokens)
for the same training-time budget and reports both validation losses:

- moe:   the named size (default `tiny`: 8 experts, top-2, expert width d_ff);
- dense: the same size with every FFN dense (`moe_every=0`) of width top_k * d_ff, so each
         token touches the same number of FFN parameters (the router's D x E gate is the only
         difference in active parameters; both counts are reported).

The recipe is the named size with optional overrides (`--experts`, `--top-k`, `--lr`, and for
the MoE alone `--moe-lr` and `--expert-ff`, the expert width: fine-grained experts); the dense
twin always has FFN width top_k * d_ff, with d_ff the MoE's expert width. Both get the same
data stream, seed and AdamW settings (the learning rate too unless `--moe-lr`). Each of
`--seeds` (default two) trains a fresh pair; the result reports every seed's validation
losses, the MoE - dense difference per seed, its mean and spread, and a loss-vs-wall-clock
curve per model (validation on `--curve-batches` fixed windows at `--curve-points` equally
spaced training times; those evaluations are not counted as training time). Equal time, also
on a shared machine: the two are trained interleaved, one step of each in turn (so load from
other processes hits both alike), and each stops once its own measured training time reaches
the budget; the learning rate warms up over the first steps, then follows a cosine over the
fraction of the time budget used (the step count is not known in advance). Validation loss is
measured at the end on the same fixed windows. Writes `runs/bench/<time>/quality_<hardware>[_<tag>].json`.

FastMoE and ES-MoE both report the MoE winning at equal compute; this measures whether we do,
at this scale. This file only orchestrates `moescale.train`; it adds no training logic.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.train.config import load_config


def _overrides(args, seed: int, run_dir: str, dense: bool, d_ff: int, top_k: int) -> dict:
    values = {"model.size": args.size, "train.steps": "1000000",
              "train.batch_size": str(args.batch_size), "train.seq_len": str(args.seq_len),
              "train.seed": str(seed), "train.eval_batches": str(args.eval_batches),
              "train.progress": "false", "train.sample_tokens": "0", "train.run_dir": run_dir,
              "train.threads": str(args.threads)}
    lr = args.lr if dense or args.moe_lr is None else args.moe_lr
    if lr is not None:
        values.update({"optim.lr": str(lr), "optim.min_lr": str(lr / 10)})
    if dense:
        values.update({"model.moe_every": "0", "model.d_ff": str(top_k * d_ff)})
    else:
        if args.experts is not None:
            values["model.num_experts"] = str(args.experts)
        values["model.top_k"] = str(top_k)
        values["model.d_ff"] = str(d_ff)
    return values


def _curve_eval(trainer, batches: int) -> float:
    """Validation loss on the first `batches` fixed windows (a cheaper point of the curve)."""
    saved = trainer.val_windows
    trainer.val_windows = saved[:batches]
    try:
        return trainer.evaluate()
    finally:
        trainer.val_windows = saved


def lr_by_time(step: int, used_s: float, budget_s: float, optim, warmup_steps: int) -> float:
    """Linear warmup over steps, then cosine decay over the fraction of the time budget used."""
    if step < warmup_steps:
        return optim.lr * (step + 1) / warmup_steps
    frac = min(1.0, used_s / budget_s)
    return optim.min_lr + (optim.lr - optim.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def run(args, seed: int) -> dict:
    from moescale.models import gpt_config
    from moescale.train.threads import auto_threads, torch_threads
    from moescale.train.trainer import Trainer

    if not args.threads:
        args.threads = auto_threads()[0]
    base = gpt_config(args.size)
    top_k = args.top_k if args.top_k is not None else base.moe.top_k
    d_ff = args.expert_ff if args.expert_ff is not None else base.moe.d_ff
    with torch_threads(args.threads):
        with tempfile.TemporaryDirectory(prefix="moescale-quality-") as root:
            trainers = {}
            for name in ("moe", "dense"):
                run_dir = os.path.join(root, name)
                cfg = load_config(None, _overrides(args, seed, run_dir, name == "dense",
                                                   d_ff, top_k))
                trainers[name] = Trainer(cfg, run_dir, out=open(os.devnull, "w"))
            used = {name: 0.0 for name in trainers}
            loss_tail = {name: [] for name in trainers}
            curve = {name: [] for name in trainers}
            marks = [args.seconds * (i + 1) / args.curve_points for i in range(args.curve_points)]
            # one step of each in turn, so that load from other processes hits both alike;
            # each stops once its own training time reaches the budget
            while any(used[n] < args.seconds for n in trainers):
                for name, trainer in trainers.items():
                    if used[name] >= args.seconds:
                        continue
                    lr = lr_by_time(trainer.step, used[name], args.seconds,
                                    trainer.config.optim, args.warmup_steps)
                    t0 = time.perf_counter()
                    record = trainer.train_step(lr=lr)
                    used[name] += time.perf_counter() - t0
                    loss_tail[name] = (loss_tail[name] + [record["loss"]])[-20:]
                    if len(curve[name]) < len(marks) - 1 and used[name] >= marks[len(curve[name])]:
                        curve[name].append(dict(train_time_s=used[name], step=trainer.step,
                                                val_loss=_curve_eval(trainer, args.curve_batches)))
            result = {}
            for name, trainer in trainers.items():
                params = trainer.params
                curve[name].append(dict(train_time_s=used[name], step=trainer.step,
                                        val_loss=_curve_eval(trainer, args.curve_batches)))
                result[name] = {
                    "val_loss": trainer.evaluate(), "curve": curve[name],
                    "train_loss_last20": sum(loss_tail[name]) / len(loss_tail[name]),
                    "steps": trainer.step, "train_time_s": used[name],
                    "lr": trainer.config.optim.lr,
                    "step_s": used[name] / trainer.step,
                    "tokens": trainer.step * args.batch_size * args.seq_len,
                    "params_total": params.total, "params_active": params.active,
                    "model": {k: trainer.model.config.to_flat()[k] for k in
                              ("n_layers", "d_model", "d_ff", "num_experts", "top_k",
                               "moe_every")},
                }
    return result


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else None, "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moescale bench quality", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="training-time budget per model (default 120)")
    parser.add_argument("--size", default="tiny", help="model size (default tiny)")
    parser.add_argument("--experts", type=int, default=None,
                        help="MoE experts per layer (default: the size's)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="experts per token (default: the size's); the dense twin's FFN "
                             "width is top_k * d_ff")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate for both (min lr = lr / 10; default: config)")
    parser.add_argument("--moe-lr", type=float, default=None,
                        help="peak learning rate for the MoE alone (default: --lr); each expert "
                             "sees only its share of the tokens")
    parser.add_argument("--expert-ff", type=int, default=None,
                        help="the MoE's expert width (default: the size's d_ff); the dense "
                             "twin's FFN width is top_k * expert-ff")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128,
                        help="tokens per sequence")
    parser.add_argument("--seeds", default="1234,1235",
                        help="comma-separated seeds, one MoE/dense pair each (default 2)")
    parser.add_argument("--eval-batches", type=int, default=32,
                        help="validation batches of the final loss")
    parser.add_argument("--curve-points", type=int, default=6,
                        help="validation points on the loss-vs-wall-clock curve")
    parser.add_argument("--curve-batches", type=int, default=8,
                        help="validation windows per curve point")
    parser.add_argument("--warmup-steps", type=int, default=20,
                        help="learning-rate warmup steps")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: auto, the CPUs the load leaves free)")
    parser.add_argument("--tag", default="", help="file-name suffix for this recipe")
    parser.add_argument("--out", default=None,
                        help="folder for quality_<hardware>[_<tag>].json (default: "
                             "runs/bench/<time>/; benchmarks/results updates the recorded one)")
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        raise ValueError(f"--seconds={args.seconds} must be > 0")
    if args.warmup_steps < 1:
        raise ValueError(f"--warmup-steps={args.warmup_steps} must be >= 1")
    if args.curve_points < 1 or args.curve_batches < 1:
        raise ValueError(f"--curve-points={args.curve_points} and --curve-batches="
                         f"{args.curve_batches} must be >= 1")
    try:
        seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--seeds={args.seeds!r} must be comma-separated integers, "
                         "e.g. 1234,1235") from None
    if not seeds:
        raise ValueError("--seeds is empty; give at least one seed, e.g. --seeds 1234,1235")
    hardware = hardware_tag(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    name = f"quality_{hardware}{'_' + args.tag if args.tag else ''}.json"
    path = result_path(str(Path(args.out) / name) if args.out else None, name)
    runs = []
    for seed in seeds:
        result = run(args, seed)
        moe, dense = result["moe"], result["dense"]
        runs.append({"seed": seed, "moe": moe, "dense": dense,
                     "moe_minus_dense": moe["val_loss"] - dense["val_loss"]})
        for name, r in (("moe", moe), ("dense", dense)):
            print(f"seed {seed} {name:<6} val loss {r['val_loss']:.4f}  train loss "
                  f"{r['train_loss_last20']:.4f}  {r['steps']} steps in "
                  f"{r['train_time_s']:.1f} s  params {r['params_total']:,} total / "
                  f"{r['params_active']:,} active")
        diffs = [r["moe_minus_dense"] for r in runs]
        payload = {
            "benchmark": "quality", "hardware": hardware, "cpu_flags": cpu_flags(),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": args.threads, "seconds_per_model": args.seconds, "size": args.size,
            "recipe": {"experts": args.experts, "top_k": args.top_k, "lr": args.lr,
                       "moe_lr": args.moe_lr, "expert_ff": args.expert_ff},
            "batch_size": args.batch_size, "seq_len": args.seq_len, "seeds": seeds,
            "runs": runs, "moe_minus_dense": _spread(diffs),
            "moe_val": _spread([r["moe"]["val_loss"] for r in runs]),
            "dense_val": _spread([r["dense"]["val_loss"] for r in runs]),
            "moe_wins_every_seed": all(d < 0 for d in diffs), "complete": len(runs) == len(seeds),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_json(path, payload)
    d = payload["moe_minus_dense"]
    print(f"MoE - dense validation loss over {len(seeds)} seeds: mean {d['mean']:+.4f} "
          f"(min {d['min']:+.4f}, max {d['max']:+.4f}); MoE "
          f"{'wins on every seed' if payload['moe_wins_every_seed'] else 'does not win on every seed'}"
          f" at equal training time ({args.seconds:.0f} s each)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
