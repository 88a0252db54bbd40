"""`moescale bench compact-optimizer`: one expert's host AdamW step per state format, beside the
8-bit optimizers of bitsandbytes and torchao on this CPU.

Times, interleaved round by round (median of `--repeats` after a warm-up), the step of one expert
of `--params` parameters with a fresh gradient:
- moescale's host optimizer on a host-tier store record (`HostOptimizer._step`: decode the
  record into fp32 work buffers, torch's fused AdamW, encode) for each `--formats` entry; fp32
  state is torch's fused AdamW on the record's rows directly;
- `bitsandbytes.optim.AdamW8bit` and `torchao.optim.AdamW8bit` (block-wise 8-bit moments, fp32
  parameter) on a CPU parameter of the same size, where the package is importable (neither is
  a dependency: `pip install bitsandbytes torchao` to compare; torchao compiles its step with
  torch.compile on first use, which is excluded from the timing).
Reports milliseconds per step and nanoseconds per parameter; writes
runs/bench/<time>/compact_optimizer_<hardware>.json (or --out) with the CPU flags.

Deliberately not here: the disk tier's bytes (bench offload-disk), quality (bench state-quality).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.offload.state_format import parse_formats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench compact-optimizer",
                                description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=2 * 1024 * 4096, help="parameters of the "
                   "expert (default: d_model 1024, d_ff 4096, the past-RAM benchmark's)")
    p.add_argument("--formats", default="fp32+fp32,bf16+int8,fp32+int8,bf16+bf16",
                   help="moescale's state formats to time, MASTER+MOMENTS comma-separated")
    p.add_argument("--repeats", type=int, default=9, help="timed interleaved rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the host optimizer "
                   "shares the cores with compute and I/O in a step)")
    p.add_argument("--out", default=None, help="the JSON (default: runs/bench/<time>/"
                   "compact_optimizer_<hardware>.json)")
    return p


def _moescale_step(fmt, numel: int):
    from moescale.offload.optimizer import AdamWConfig, HostOptimizer
    from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig
    store = ExpertStore(StoreConfig(tier="host", state=fmt))
    store.add_layer(ExpertLayout([("w", (numel,))]), 1, lambda e: torch.randn(numel) * 0.02)
    opt = HostOptimizer(store, AdamWConfig(lr=1e-3))
    grad = torch.randn(numel) * 1e-3

    def step():
        rec = store.acquire((0, 0))
        rec.grad_P.copy_(grad)
        store.release((0, 0))
        opt._step([(0, 0)], opt.hparams(), None)
    return step


def _torch_optimizer_step(make, numel: int):
    param = torch.nn.Parameter(torch.randn(numel) * 0.02)
    opt = make([param])
    grad = torch.randn(numel) * 1e-3

    def step():
        param.grad = grad.clone()
        opt.step()
    return step


def _peers(numel: int) -> dict:
    out = {}
    try:
        import bitsandbytes as bnb
        out[f"bitsandbytes {bnb.__version__} AdamW8bit"] = _torch_optimizer_step(
            lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, min_8bit_size=0), numel)
    except Exception as err:     # not installed, or no CPU support in this version
        print(f"bitsandbytes skipped: {type(err).__name__}: {str(err)[:120]}")
    try:
        import torchao
        from torchao.optim import AdamW8bit
        out[f"torchao {torchao.__version__} AdamW8bit"] = _torch_optimizer_step(
            lambda ps: AdamW8bit(ps, lr=1e-3), numel)
    except Exception as err:
        print(f"torchao skipped: {type(err).__name__}: {str(err)[:120]}")
    return out


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        formats = parse_formats(args.formats)
    except ValueError as err:
        print(f"moescale bench compact-optimizer: {err}", file=sys.stderr)
        return 2
    if args.params < 1 or args.repeats < 1 or args.threads < 1:
        print("moescale bench compact-optimizer: --params, --repeats and --threads must be >= 1",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    steps = {f"moescale {fmt.name}": _moescale_step(fmt, args.params) for fmt in formats}
    steps.update(_peers(args.params))
    for step in steps.values():       # warm-up (torchao compiles here)
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    rows = {name: dict(median_ms=1e3 * statistics.median(t), min_ms=1e3 * min(t),
                       max_ms=1e3 * max(t),
                       ns_per_param=1e9 * statistics.median(t) / args.params)
            for name, t in times.items()}
    print(f"\none expert of {args.params:,} parameters, {args.threads} thread(s), "
          f"{args.repeats} interleaved repetitions")
    print(f"{'optimizer':<44} {'median ms':>10} {'min':>8} {'max':>8} {'ns/param':>9}")
    for name, r in rows.items():
        print(f"{name:<44} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{r['ns_per_param']:>9.2f}")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(args.out, f"compact_optimizer_{tag}.json")
    write_json(out, dict(benchmark="compact-optimizer", hardware=tag, cpu_flags=cpu_flags(),
                         config=vars(args), results=rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
