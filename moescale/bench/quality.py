"""Quality at equal compute: the MoE GPT against a dense GPT with the same ACTIVE parameters.

`moescale bench quality [--seconds 120] [--size tiny] ...` (or `python benchmarks/quality.py`)
trains two models on the built-in corpus (the Python standard library's source, byte tokens)
for the same training-time budget and reports both validation losses:

- moe:   the named size (default `tiny`: 8 experts, top-2, expert width d_ff);
- dense: the same size with every FFN dense (`moe_every=0`) of width top_k * d_ff, so each
         token touches the same number of FFN parameters (the router's D x E gate is the only
         difference in active parameters; both counts are reported).

Both get the same data stream, seed and AdamW settings. Equal time, also on a shared machine:
the two are trained interleaved, one step of each in turn (so load from other processes hits
both alike), and each stops once its own measured training time reaches the budget; the
learning rate warms up over the first steps, then follows a cosine over the fraction of the
time budget used (the step count is not known in advance). Validation loss is measured at the
end on the same fixed windows. Writes `benchmarks/results/quality_<hardware>.json`.

FastMoE and ES-MoE both report the MoE winning at equal compute; this measures whether we do,
at this scale. This file only orchestrates `moescale.train`; it adds no training logic.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from moescale.bench.measure import hardware_tag, write_json
from moescale.train.config import load_config


def _overrides(args, run_dir: str, dense: bool, d_ff: int, top_k: int) -> dict:
    values = {"model.size": args.size, "train.steps": "1000000",
              "train.batch_size": str(args.batch_size), "train.seq_len": str(args.seq_len),
              "train.seed": str(args.seed), "train.eval_batches": str(args.eval_batches),
              "train.progress": "false", "train.sample_tokens": "0", "train.run_dir": run_dir}
    if dense:
        values.update({"model.moe_every": "0", "model.d_ff": str(top_k * d_ff)})
    return values


def lr_by_time(step: int, used_s: float, budget_s: float, optim, warmup_steps: int) -> float:
    """Linear warmup over steps, then cosine decay over the fraction of the time budget used."""
    if step < warmup_steps:
        return optim.lr * (step + 1) / warmup_steps
    frac = min(1.0, used_s / budget_s)
    return optim.min_lr + (optim.lr - optim.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def run(args) -> dict:
    from moescale.models import gpt_config
    from moescale.train.trainer import Trainer, auto_threads

    threads = torch.get_num_threads()
    if not args.threads:
        args.threads = auto_threads()[0]
    torch.set_num_threads(args.threads)
    base = gpt_config(args.size)
    try:
        with tempfile.TemporaryDirectory(prefix="moescale-quality-") as root:
            trainers = {}
            for name in ("moe", "dense"):
                run_dir = os.path.join(root, name)
                cfg = load_config(None, _overrides(args, run_dir, name == "dense", base.d_ff,
                                                   base.top_k))
                trainers[name] = Trainer(cfg, run_dir, out=open(os.devnull, "w"))
            used = {name: 0.0 for name in trainers}
            loss_tail = {name: [] for name in trainers}
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
            result = {}
            for name, trainer in trainers.items():
                params = trainer.params
                result[name] = {
                    "val_loss": trainer.evaluate(),
                    "train_loss_last20": sum(loss_tail[name]) / len(loss_tail[name]),
                    "steps": trainer.step, "train_time_s": used[name],
                    "step_s": used[name] / trainer.step,
                    "tokens": trainer.step * args.batch_size * args.seq_len,
                    "params_total": params.total, "params_active": params.active,
                    "model": {k: getattr(trainer.model.config, k) for k in
                              ("n_layers", "d_model", "d_ff", "num_experts", "top_k",
                               "moe_every")},
                }
    finally:
        torch.set_num_threads(threads)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moescale bench quality", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="training-time budget per model (default 120)")
    parser.add_argument("--size", default="tiny", help="model size (default tiny)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: auto, the CPUs the load leaves free)")
    parser.add_argument("--out", default="benchmarks/results",
                        help="folder for quality_<hardware>.json")
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        raise ValueError(f"--seconds={args.seconds} must be > 0")
    if args.warmup_steps < 1:
        raise ValueError(f"--warmup-steps={args.warmup_steps} must be >= 1")
    result = run(args)
    moe, dense = result["moe"], result["dense"]
    payload = {
        "benchmark": "quality", "hardware": hardware_tag(torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")), "torch": torch.__version__,
        "python": platform.python_version(), "threads": args.threads,
        "seconds_per_model": args.seconds, "size": args.size, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "seed": args.seed, "moe": moe, "dense": dense,
        "moe_wins": moe["val_loss"] < dense["val_loss"],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = Path(args.out) / f"quality_{payload['hardware']}.json"
    write_json(path, payload)
    for name, r in (("moe", moe), ("dense", dense)):
        print(f"{name:<6} val loss {r['val_loss']:.4f}  train loss {r['train_loss_last20']:.4f}  "
              f"{r['steps']} steps in {r['train_time_s']:.1f} s  "
              f"params {r['params_total']:,} total / {r['params_active']:,} active")
    print(f"MoE {'wins' if payload['moe_wins'] else 'loses'} at equal training time "
          f"({args.seconds:.0f} s each): {moe['val_loss']:.4f} vs {dense['val_loss']:.4f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
