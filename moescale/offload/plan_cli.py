"""`moescale plan`: memory per tier, predicted step time and the pick of each offloading mode.

    moescale plan --moe-layers 24 --d-model 1536 --d-ff 6144 --experts 64 --tokens 8192 \
        --device-gb 40 --host-gb 512 --disk-gb 4096 [--rates a100|measure] [--max-experts] \
        [--dense-params N] [--vocab-size V [--untied-embeddings]]

`--rates a100` (default) uses ES-MoE's machine (A100-40GB, PCIe 4, NVMe); `--rates measure`
measures this machine first at this model's sizes (expert GEMMs, expert copy, host AdamW: each
the median of warm timings; the disk through the store's direct-I/O path on a 1 GiB file under
`--disk-dir`: about half a minute). `--max-experts` also
prints the largest expert count each mode holds within the budgets. `--dense-params` (every
non-expert parameter but the vocabulary's: attention, norms, routers, dense FFN layers; default
4 d_model^2 per layer + the routers) and `--vocab-size` (token embedding and LM head, tied
unless `--untied-embeddings`; default 0: not counted) put the dense part's weights, AdamW state,
logits and compute into every mode's device memory and step time. Under the table, each mode's
step time by part: the work of each part and what it adds to the step (work that overlaps
another part adds only its excess, so the added times sum to the step).

Deliberately not here: running anything but the measurement probes.
"""

from __future__ import annotations

import argparse

from moescale.offload.planner import (A100_NODE, MODES, Budgets, ModelSpec, fmt_seconds,
                                      largest_experts, plan)
from moescale.offload.rates import measure_rates
from moescale.offload.state_format import MASTERS, MOMENTS
from moescale.sizes import fmt_bytes

GB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale plan", description=__doc__.split("\n")[0])
    p.add_argument("--moe-layers", type=int, default=24,
                   help="MoE layers of the model")
    p.add_argument("--d-model", type=int, default=1536,
                   help="model width")
    p.add_argument("--d-ff", type=int, default=6144,
                   help="hidden width of each expert")
    p.add_argument("--experts", type=int, default=64,
                   help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2,
                   help="experts per token")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, help="per optimizer step")
    p.add_argument("--glu", action="store_true",
                   help="gated (GLU) experts: three weight matrices, not two")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="the experts' compute precision on the device")
    p.add_argument("--device-gb", type=float, default=40,
                   help="device memory for training, GB")
    p.add_argument("--host-gb", type=float, default=512,
                   help="host RAM the plan may use, GB")
    p.add_argument("--disk-gb", type=float, default=4096,
                   help="disk space the plan may use, GB")
    p.add_argument("--host-cache-gb", type=float, default=None,
                   help="disk tier: host RAM caching expert records, GB (default: what the host "
                        "budget leaves)")
    p.add_argument("--step-mode", default="eager", choices=["eager", "deferred"],
                   help="expert optimizer steps: eager (each after its backward) or "
                        "deferred (after the whole backward)")
    p.add_argument("--master", default="fp32", choices=list(MASTERS), help="the store's expert "
                   "master weights (bf16: stochastic rounding, half the bytes)")
    p.add_argument("--moments", default="fp32", choices=list(MOMENTS), help="the store's Adam "
                   "moments (int8: block-wise dynamic quantisation)")
    p.add_argument("--rates", default="a100", choices=["a100", "measure"],
                   help="compute / copy / disk rates: a100 (published A100 + NVMe figures) or "
                        "measure (this machine)")
    p.add_argument("--disk-dir", default=None, help="where --rates measure probes the disk")
    p.add_argument("--max-experts", action="store_true",
                   help="also print the largest expert count each tier fits in the budgets")
    p.add_argument("--dense-params", type=int, default=None,
                   help="non-expert parameters besides the vocabulary's (default: 4 d_model^2 "
                        "per layer + routers)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="token embedding + LM head rows (0: not counted)")
    p.add_argument("--untied-embeddings", action="store_true",
                   help="the LM head has its own weights (default: tied to the embedding)")
    return p


def breakdown_lines(ests) -> list[str]:
    """Each mode's step time by part: 'work / added to the step' per cell."""
    names = list(dict.fromkeys(name for e in ests for name in e.breakdown))
    width = max(map(len, names)) + 2
    lines = [f"{'part':<{width}}" + "".join(f"{e.mode:>24}" for e in ests)]
    for name in names:
        cells = []
        for e in ests:
            work, added = e.breakdown.get(name, (None, None))
            cells.append("-" if work is None else
                         f"{fmt_seconds(work)} / {fmt_seconds(added)}")
        lines.append(f"{name:<{width}}" + "".join(f"{c:>24}" for c in cells))
    lines.append(f"{'step':<{width}}" + "".join(f"{fmt_seconds(e.step_s):>24}" for e in ests))
    return lines


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    spec = ModelSpec(moe_layers=args.moe_layers, d_model=args.d_model, d_ff=args.d_ff,
                     num_experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                     micro_batches=args.micro_batches, glu=args.glu, dtype=args.dtype,
                     dense_params=args.dense_params, vocab_size=args.vocab_size,
                     tie_embeddings=not args.untied_embeddings, master=args.master,
                     moments=args.moments)
    budgets = Budgets(device_bytes=int(args.device_gb * GB), host_bytes=int(args.host_gb * GB),
                      disk_bytes=int(args.disk_gb * GB),
                      host_cache_bytes=None if args.host_cache_gb is None
                      else int(args.host_cache_gb * GB))
    rates = measure_rates(args.disk_dir, **spec.probe_sizes()) if args.rates == "measure" \
        else A100_NODE
    ests, pick = plan(spec, budgets, rates, step_mode=args.step_mode)
    print(f"model: {spec.moe_layers} MoE layers, d_model {spec.d_model}, d_ff {spec.d_ff}, "
          f"{spec.num_experts} experts, top-{spec.top_k}, {spec.tokens} tokens, {spec.dtype}, "
          f"expert state {spec.state.name}; "
          f"dense {spec.dense_params:,} + vocabulary {spec.vocab_params:,} parameters")
    print(f"budgets: device {fmt_bytes(budgets.device_bytes)}, host "
          f"{fmt_bytes(budgets.host_bytes)}, disk {fmt_bytes(budgets.disk_bytes)}; rates: "
          f"{args.rates}")
    print(f"\n{'mode':<8} {'device':>11} {'host':>11} {'disk':>11} {'fits':>5} {'step':>11}")
    for e in ests:
        print(f"{e.mode:<8} {fmt_bytes(e.device_bytes):>11} {fmt_bytes(e.host_bytes):>11} "
              f"{fmt_bytes(e.disk_bytes):>11} {'yes' if e.fits else 'no':>5} "
              f"{fmt_seconds(e.step_s):>11}")
    print("\nstep time by part (work / added to the step; overlapped work adds its excess):")
    print("\n".join(breakdown_lines(ests)))
    if args.max_experts:
        print("\nlargest expert count per layer that fits:")
        for mode in MODES:
            print(f"  {mode:<8} {largest_experts(spec, budgets, rates, mode):>8}")
    if pick is None:
        print("\npick: none fits; raise a budget or shrink the model")
        return 1
    print(f"\npick: {pick}")
    return 0
