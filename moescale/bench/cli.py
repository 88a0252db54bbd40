"""`moescale bench NAME [options]`: routes to one benchmark module's `main(argv) -> int`.

The registry maps a benchmark name to its module and a one-line description; adding a
benchmark is one entry here plus its module. This file runs nothing itself.
"""

from __future__ import annotations

import importlib

from moescale.cli import usage_text

BENCHMARKS = {
    "layer": ("moescale.bench.layer",
              "one MoE layer, forward + backward, vs the GEMM floor, HF Mixtral, DeepSpeed-MoE"),
    "quality": ("moescale.bench.quality",
                "MoE GPT vs a dense GPT with the same active parameters, equal training time"),
    "placement": ("moescale.bench.placement", "device load of static placement, LPT, LPT + split"),
    "offload": ("moescale.bench.offload", "host-tier offloading vs all-resident step time"),
    "offload-disk": ("moescale.bench.offload_disk",
                     "disk tier beyond RAM: >= 8 GB expert state, peak RSS, bytes moved"),
    "state-quality": ("moescale.bench.state_quality",
                      "compact expert state formats vs fp32: validation loss of the default "
                      "model, seeds"),
    "compact-optimizer": ("moescale.bench.compact_optimizer",
                          "one expert's host AdamW step per state format vs bitsandbytes and "
                          "torchao 8-bit AdamW"),
    "plan-check": ("moescale.bench.plan_check", "planner step-time predictions vs measured"),
    "expert-shards": ("moescale.bench.expert_shards",
                      "sharded expert checkpoints on the disk tier: per-rank peak RSS vs share"),
    "ep-memory": ("moescale.bench.ep_memory",
                  "pipelined all-to-all: real per-rank peak vs formula, step time, auto pick"),
    "ep-speed": ("moescale.bench.ep_speed",
                 "pipelined all-to-all: step time per chunk count, tuner pick, overlap"),
    "ep-offload": ("moescale.bench.ep_offload",
                   "pipelined EP with host-tier experts vs the unpipelined offloaded path"),
    "scale-out": ("moescale.bench.scale_out",
                  "sharded (FSDP2) vs replicated dense half: memory per rank at N = 2, 4; "
                  "step time"),
    "generate": ("moescale.bench.generate",
                 "KV-cached generation with disk-tier experts: bytes/token vs minimum, disk rate"),
    "data": ("moescale.bench.data_tokenize",
             "tokenizing a text folder into the token cache: throughput, peak memory"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage_text("moescale bench", BENCHMARKS, "benchmark"))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark {name!r} is unknown; choose one of {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest) or 0)
