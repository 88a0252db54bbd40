"""`moescale bench plan-check`: the planner's predicted host-tier step time vs measured.

Measures this machine's rates (`planner.measure_rates`: GEMM, copy, host AdamW, disk), then
for three CPU configurations of a residual MoE stack trained on the host tier (fp32, eager,
device budget of 3 experts) times real steps (forward, backward, expert and dense optimizer
steps; median after a warm-up) and compares them with `planner.estimate(..., "host")`.
Target (issue 3): every prediction within 25% of the measurement. Writes
benchmarks/results/plan_check_<hardware>.json.

Deliberately not here: GPU configurations (the same code with CUDA rates).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from moescale.bench.measure import hardware_tag, write_json
from moescale.bench.offload import MoEStack, training_step
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.planner import Budgets, ModelSpec, estimate, measure_rates

CONFIGS = {  # name: (layers, d_model, d_ff, experts, tokens)
    "d256-e8-t1024": (2, 256, 1024, 8, 1024),
    "d512-e8-t1024": (2, 512, 2048, 8, 1024),
    "d512-e16-t2048": (2, 512, 2048, 16, 2048),
}


def _measure(layers, d_model, d_ff, experts, tokens, runs) -> float:
    torch.manual_seed(0)
    model = MoEStack(layers, d_model, d_ff, experts, 2)
    engine = offload_moe(model, OffloadConfig(device="cpu", device_budget_experts=3,
                                              step_mode="eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine.follow(opt)
    x = torch.randn(tokens, d_model)
    times = []
    for _ in range(1 + runs):
        start = time.perf_counter()
        training_step(model, x, opt, engine)
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moescale bench plan-check", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rates = measure_rates()
    print(f"rates: {rates}")
    budgets = Budgets(device_bytes=1 << 40, host_bytes=1 << 40, disk_bytes=1 << 40)
    rows = []
    for name in args.configs.split(","):
        layers, d_model, d_ff, experts, tokens = CONFIGS[name]
        spec = ModelSpec(moe_layers=layers, d_model=d_model, d_ff=d_ff, num_experts=experts,
                         top_k=2, tokens=tokens, dtype="float32",
                         dense_params=layers * (d_model * experts + 2 * d_model))
        predicted = estimate(spec, budgets, rates, "host").step_s
        measured = _measure(layers, d_model, d_ff, experts, tokens, args.runs)
        err = predicted / measured - 1
        rows.append(dict(config=name, predicted_s=predicted, measured_s=measured,
                         relative_error=err, passed=abs(err) <= 0.25))
        print(f"{name:<16} predicted {predicted * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms"
              f"  error {err:+.1%}  {'PASS' if abs(err) <= 0.25 else 'FAIL'}", flush=True)
    tag = hardware_tag(torch.device("cpu"))
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"plan_check_{tag}.json"
    write_json(out, dict(benchmark="plan-check", hardware=tag, rates=copy.copy(vars(rates)),
                         results=rows, targets=[dict(name=f"{r['config']} within 25%",
                                                     passed=r["passed"],
                                                     value=r["relative_error"]) for r in rows]))
    print(f"wrote {out}")
    return 0
