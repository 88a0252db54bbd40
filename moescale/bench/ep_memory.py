"""Pipelined all-to-all memory: saved activations and pipeline buffers per strategy and chunks.

On W gloo ranks (real processes), for every reuse strategy (none, S1-S4) and chunk count, it
measures on each rank:
  - the bytes `PipelinedAllToAll` saves for backward (saved_tensors_hooks, each storage once,
    parameters and the layer input excluded: the caller holds those anyway),
  - its receive-buffer bytes and the bytes it offloaded to host,
  - the whole MoE layer's saved bytes (router, gather, combine included) + buffers,
and prints them beside the formulas of moescale.parallel.cost_model (MPipeMoE's accounting:
dispatched input S*D*b, hidden G*S*F*b, min(2, C) receive slots of ceil(S/C) rows).
Checks: measured within 10% of the formula; the layer at 4 chunks with a reuse strategy
needs <= 0.55x the activation + buffer memory of 1 chunk without reuse (MPipeMoE: -47%).

    moescale bench ep-memory [--world 2] [--tokens 512] [--d-model 128] [--d-ff 512]
        [--experts 8] [--glu] [--out PATH]

Writes benchmarks/results/ep_memory_<hardware>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moescale.bench.measure import SavedBytes, hardware_tag, write_json
from moescale.parallel.launch import run_local

STRATEGIES = ("none", "S1", "S2", "S3", "S4")
CHUNKS = (1, 2, 3, 4, 8)


def _rank_body(rank: int, world: int, args: dict) -> list[dict]:
    from moescale.dispatch.plan import build_plan
    from moescale.layers.moe import MoE
    from moescale.parallel.cost_model import LayerShape, memory_bytes
    from moescale.parallel.expert_parallel import shard_moe
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.parallel.pipeline import (PipelinedExpertParallelDispatcher,
                                            run_grouped_pipeline)

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=60))
    torch.manual_seed(0)
    full = MoE(args["d_model"], args["experts"], 2, d_ff=args["d_ff"], glu=args["glu"])
    x = torch.randn(args["tokens"], args["d_model"], generator=torch.Generator().manual_seed(rank))
    rows = []
    for strategy in STRATEGIES:
        for chunks in CHUNKS:
            disp = PipelinedExpertParallelDispatcher(groups, args["experts"], num_chunks=chunks,
                                                     strategy=strategy)
            moe = shard_moe(full, groups, disp)
            params = list(moe.parameters())
            xin = x.clone().requires_grad_(True)
            with SavedBytes(params + [xin]) as layer_probe:
                y = moe(xin)
            layer_saved = layer_probe.nbytes
            layer_buffers = disp.last_stats.get("recv_buffer_bytes", 0)
            y.square().mean().backward()
            # the pipeline Function alone, on the same routing
            with torch.no_grad():
                route = moe.router(x)
                plan = build_plan(route.scores_TK, route.expert_ids_TK, args["experts"])
            send, recv, _ = disp._exchange(plan, x.device)
            spec = disp.spec(plan, send, recv, chunks, strategy)
            with SavedBytes(params + [xin]) as probe:
                out = run_grouped_pipeline(xin, spec, moe.experts.local)
            out.square().mean().backward()
            received = sum(sum(r) for r in recv)
            formula = memory_bytes(LayerShape(rows=received, d_model=args["d_model"],
                                              d_ff=args["d_ff"], glu=args["glu"], elem_bytes=4,
                                              ep_size=groups.ep_size), strategy, chunks)
            rows.append(dict(
                rank=rank, strategy=strategy, chunks=chunks, rows_received=received,
                saved_bytes=probe.nbytes, buffer_bytes=spec.stats.get("recv_buffer_bytes", 0),
                host_bytes=spec.stats["offloaded_bytes"],
                formula_saved=formula.device_saved, formula_buffers=formula.buffers,
                formula_host=formula.host, layer_saved_bytes=layer_saved,
                layer_buffer_bytes=layer_buffers))
    return rows


def _within(measured: int, formula: int, tol: float = 0.10) -> bool:
    if formula == 0:
        return measured == 0
    return abs(measured - formula) <= tol * formula


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--glu", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    ns = ap.parse_args(argv)
    args = dict(tokens=ns.tokens, d_model=ns.d_model, d_ff=ns.d_ff, experts=ns.experts,
                glu=ns.glu)
    results = run_local(_rank_body, ns.world, (args,), timeout_s=120, deadline_s=900)
    rows = [row for r in results for row in r.value]
    base = {r["rank"]: r["layer_saved_bytes"] + r["layer_buffer_bytes"] for r in rows
            if r["strategy"] == "none" and r["chunks"] == 1}
    ok = True
    print(f"{'rank':>4} {'strat':>5} {'C':>2} | {'saved':>9} {'formula':>9} | {'buffers':>9} "
          f"{'formula':>9} | {'host':>9} {'formula':>9} | {'layer act+buf':>13} {'vs none/C1':>10}")
    for r in rows:
        device = r["saved_bytes"] + r["buffer_bytes"]
        r["within_10pct"] = _within(device, r["formula_saved"] + r["formula_buffers"]) and \
            _within(r["host_bytes"], r["formula_host"])
        layer = r["layer_saved_bytes"] + r["layer_buffer_bytes"]
        r["layer_ratio_vs_none_1chunk"] = layer / base[r["rank"]]
        ok &= r["within_10pct"]
        print(f"{r['rank']:>4} {r['strategy']:>5} {r['chunks']:>2} | {r['saved_bytes']:>9} "
              f"{r['formula_saved']:>9} | {r['buffer_bytes']:>9} {r['formula_buffers']:>9} | "
              f"{r['host_bytes']:>9} {r['formula_host']:>9} | {layer:>13} "
              f"{r['layer_ratio_vs_none_1chunk']:>10.3f}")
    at4 = {(r["rank"], r["strategy"]): r["layer_ratio_vs_none_1chunk"] for r in rows
           if r["chunks"] == 4 and r["strategy"] != "none"}
    ratio_ok = all(v <= 0.55 for v in at4.values())
    print(f"measured within 10% of the formulas: {ok}")
    print(f"layer activation+buffer at 4 chunks (S1-S4) / none at 1 chunk: "
          f"max {max(at4.values()):.3f} (target <= 0.55): {ratio_ok}")
    out = Path(ns.out) if ns.out else \
        Path("benchmarks/results") / f"ep_memory_{hardware_tag(torch.device('cpu'))}.json"
    write_json(out, dict(config=dict(world=ns.world, **args), rows=rows,
                         within_10pct=ok, ratio_at_4_chunks_ok=ratio_ok,
                         targets={"within 10% of the formulas": ok,
                                  "4 chunks <= 0.55x of 1 chunk": ratio_ok}))
    print(f"wrote {out}")
    return 0 if ok and ratio_ok else 1
