"""`moescale bench offload`: the step-time cost of offloading experts (host tier) vs resident,
stated with its noise.

A stack of residual MoE layers (no attention: the experts dominate, the worst case for
offloading) is trained with AdamW, one full step (forward, backward, optimizer) per timed
repetition, for each implementation, interleaved and rotated (see measure.py), >= 15
repetitions after one warm-up:

- `resident`: every expert a parameter, torch.optim.AdamW(fused=True) over all of them (the
  same fused kernel the host optimizer uses, so the comparison is of placement, not kernels);
- `resident-copy`: an identical second resident model, the null control: its ratio to
  `resident` must be 1.0 within the interval, or the run is biased and its ratios are not
  trusted;
- `host-b{N}-{mode}`: `offload_moe(tier="host", device_budget_experts=N, step_mode=mode)`,
  the dense part on torch.optim.AdamW following the same hyper-parameters; with `--formats`,
  `host-b{N}-{mode}-{master}+{moments}` for compact expert state, whose ratio to the fp32
  host store of the same budget and mode is reported too (issue 27: <= 1.10x).

For each implementation: the median step time, and the ratio to resident as the geometric mean
of the per-repetition paired ratios with a 95% confidence interval (stats.paired_ratio: the
t-interval of the log-ratios), the device peak against its budget. Target (issue 3): host tier
with a 2-expert device budget <= 1.10x resident: passed when the whole interval lies at or
below 1.10. Writes runs/bench/<time>/offload_<hardware>.json with the CPU flags. On a CPU
the "device" is simulated: uploads are memory copies on the copy thread, so this measures the
machinery's overhead (copies, threads, per-expert walks), not PCIe. `--device cuda` runs the
same on a GPU (CudaDevice, pinned host store), `--dtype bfloat16` under autocast.

Deliberately not here: the disk tier (bench offload-disk).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from moescale.bench.disk_probe import cpu_flags
from moescale.bench.measure import (Timed, hardware_tag, result_path, time_interleaved,
                                     write_json)
from moescale.bench.stats import paired_ratio
from moescale.layers.moe import MoE, collect_aux_loss
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.state_format import parse_formats


class MoEStack(nn.Module):
    def __init__(self, layers, d_model, d_ff, experts, top_k):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.moes = nn.ModuleList(MoE(d_model, experts, top_k, d_ff=d_ff)
                                  for _ in range(layers))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x.square().mean() + collect_aux_loss(self)


def training_step(model, x, opt, engine=None, autocast_bf16: bool = False) -> float:
    """One timed iteration: forward + backward, expert steps, dense step, zero_grad; with an
    engine, waits for the expert steps (no credit for overlapping them with the next forward).
    Returns the loss."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        loss = model(x)
    loss.backward()
    if engine is not None:
        engine.step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if engine is not None:
        engine.synchronize()
    return loss.item()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench offload", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2,
                   help="MoE layers")
    p.add_argument("--d-model", type=int, default=512,
                   help="model width")
    p.add_argument("--d-ff", type=int, default=2048,
                   help="expert hidden width")
    p.add_argument("--experts", type=int, default=8,
                   help="experts per layer")
    p.add_argument("--top-k", type=int, default=2,
                   help="experts per token")
    p.add_argument("--tokens", type=int, default=2048,
                   help="tokens per step")
    p.add_argument("--runs", type=int, default=15, help="timed repetitions (>= 2; 15+ for "
                   "an interval narrow enough to resolve a 10%% overhead)")
    p.add_argument("--budgets", type=str, default="2,3", help="device budgets, in experts")
    p.add_argument("--modes", type=str, default="eager,deferred",
                   help="comma-separated expert step modes: eager, deferred")
    p.add_argument("--formats", default="fp32+fp32", help="expert state formats of the host "
                   "store, MASTER+MOMENTS comma-separated; a compact one is also compared with "
                   "fp32 state at the same budget and mode")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: a SimulatedDevice; cuda: the GPU (experts on the host, pinned)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute precision")
    p.add_argument("--out", type=str, default=None,
                   help="JSON path (default: under runs/bench/; a path under "
                        "benchmarks/results updates the recorded result)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.runs < 2:
        raise ValueError(f"--runs={args.runs} must be >= 2 (the interval needs pairs)")
    torch.manual_seed(0)
    device = torch.device(args.device)
    base = MoEStack(args.layers, args.d_model, args.d_ff, args.experts, args.top_k).to(device)
    x = torch.randn(args.tokens, args.d_model, device=device)
    lowp = args.dtype == "bfloat16"
    items, engines = [], {}

    def make(name, model, opt, engine):
        def step():
            training_step(model, x, opt, engine, autocast_bf16=lowp)

        items.append(Timed(name=name, step=step, reset=lambda: None, runs=args.runs, warmup=1))

    for name in ("resident", "resident-copy"):
        resident = copy.deepcopy(base)
        make(name, resident, torch.optim.AdamW(resident.parameters(), lr=1e-4, fused=True),
             None)
    formats = parse_formats(args.formats)
    for budget in [float(b) for b in args.budgets.split(",")]:
        for mode in args.modes.split(","):
            for fmt in formats:
                model = copy.deepcopy(base)
                engine = offload_moe(model, OffloadConfig(
                    device=args.device, device_budget_experts=budget, step_mode=mode,
                    compute_dtype=args.dtype, master=fmt.master, moments=fmt.moments))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                engine.follow(opt)
                name = f"host-b{budget:g}-{mode}" + \
                    ("" if fmt.exact else f"-{fmt.master}+{fmt.moments}")
                engines[name] = engine
                make(name, model, opt, engine)
    time_interleaved(items, device, progress=lambda line: print(line, flush=True), rotate=True)
    ref = items[0]
    rows = []
    print(f"\n{'implementation':<20} {'median ms':>10} {'x resident [95% CI]':>28} "
          f"{'device peak/budget':>20}")
    for it in items:
        eng = engines.get(it.name)
        peak = f"{eng.device.peak_bytes >> 20} / {eng.device.budget_bytes >> 20} MiB" \
            if eng else "-"
        interval = paired_ratio(it.times_s, ref.times_s) if it is not ref else None
        shown = "1 (reference)" if interval is None else \
            f"{interval.ratio:.3f} [{interval.low:.3f}, {interval.high:.3f}]"
        print(f"{it.name:<20} {it.median_s * 1e3:10.1f} {shown:>28} {peak:>20}")
        rows.append(dict(name=it.name, median_s=it.median_s, times_s=it.times_s,
                         warmup_s=it.warmup_s,
                         ratio=None if interval is None else interval.as_dict(),
                         device_peak_bytes=eng.device.peak_bytes if eng else None,
                         device_budget_bytes=eng.device.budget_bytes if eng else None,
                         uploads=eng.cache.num_uploads if eng else None))
    targets = []
    for r in rows:
        ci = r["ratio"]
        if r["name"] == "resident-copy":
            ok = ci["low"] <= 1.0 <= ci["high"]
            targets.append(dict(name="null control: resident-copy interval contains 1.0",
                                value=ci, passed=ok))
            print(f"{'PASS' if ok else 'FAIL'}: null control resident-copy = {ci['ratio']:.3f}x "
                  f"[{ci['low']:.3f}, {ci['high']:.3f}] (must contain 1.0)")
        elif r["name"].startswith("host-b2-") and "+" not in r["name"]:
            ok = ci["high"] <= 1.10
            targets.append(dict(name=f"{r['name']} <= 1.10x resident (upper 95% bound)",
                                value=ci, passed=ok))
            print(f"{'PASS' if ok else 'FAIL'}: {r['name']} = {ci['ratio']:.3f}x "
                  f"[{ci['low']:.3f}, {ci['high']:.3f}] (target: upper bound <= 1.10x)")
    by_name = {it.name: it for it in items}
    for it in items:           # compact state against fp32 state, same budget and mode
        base_name = it.name.rsplit("-", 1)[0] if "+" in it.name else None
        if base_name in by_name:
            ci = paired_ratio(it.times_s, by_name[base_name].times_s).as_dict()
            ok = ci["high"] <= 1.10
            targets.append(dict(name=f"{it.name} <= 1.10x {base_name} (upper 95% bound)",
                                value=ci, passed=ok))
            print(f"{'PASS' if ok else 'FAIL'}: {it.name} = {ci['ratio']:.3f}x {base_name} "
                  f"[{ci['low']:.3f}, {ci['high']:.3f}] (target: upper bound <= 1.10x)")
    for eng in engines.values():
        eng.close()
    tag = hardware_tag(device)
    out = result_path(args.out, f"offload_{tag}.json")
    write_json(out, dict(benchmark="offload", hardware=tag, cpu_flags=cpu_flags(),
                         config=vars(args), torch_threads=torch.get_num_threads(),
                         interval="95% t-interval of the paired per-repetition log-ratios "
                                  "to resident (geometric mean)",
                         results=rows, targets=targets, resident_median_s=ref.median_s))
    print(f"wrote {out}")
    return 0
