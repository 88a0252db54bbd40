"""`moescale bench layer`: one MoE layer, forward + backward, against its floor and its peers.

For each config (width, experts, tokens) and dtype it builds, on the same weights and input:
the floor (the routed rows through plain matmul FFNs, dense or evenly split; the faster one
counts), moescale's `MoE`, the naive PyTorch loop (boolean masks + `index_add_`), Hugging
Face's Mixtral block (eager / grouped_mm / batched_mm) and DeepSpeed-MoE (capacity 1.0 and
2.0) when installed, and the MoE's routing and data movement alone (layer_bound.py: moescale's
router and combine on identity experts), whose time added to the floor's is what a dropless
MoE reaches when its expert work costs exactly the floor's. It times
`(y * g).sum().backward()` with a fixed random g, median of
`--repeats` runs after a warm-up, all implementations interleaved in one loop (round-robin per
repetition, start rotated each repetition) so that a noisy shared machine slows them alike;
moescale's ratios to the floor and to the naive loop come with a 95% interval over the paired
repetitions (bench/stats.py). It counts the activation bytes each saves for backward
(`saved_tensors_hooks`) and, in a fresh process per implementation, the peak RSS delta of one
forward + backward (layer_memory.py; floors, moescale and the naive loop). `--expert both` runs
GELU FFN and SiLU GLU experts. The JSON records the CPU's flags and the GEMM each dtype uses.

Rows: routed rows actually computed per step (tokens x k dropless; kept choices under a
capacity). Peers that would take minutes or tens of GB at full size (bf16 where torch's own
bf16 GEMM is slow; batched_mm's per-row weight copies) run on fewer tokens and are compared in
rows/s; the table marks them. Results: a printed table and JSON under runs/bench/<time>/
with the hardware in the file name.

This file does not tune anything and never changes torch's thread settings.

Legend: T tokens, R routed rows, D model width, F expert hidden width, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from moescale.bench import layer_impls as impls
from moescale.bench import layer_memory
from moescale.bench.disk_probe import cpu_flags
from moescale.bench.layer_bound import build_movement, movement_bound
from moescale.bench.measure import (Timed, hardware_tag, result_path, time_interleaved,
                                     write_json)
from moescale.bench.stats import paired_ratio
from moescale.layers.grouped_ffn import lowp_gemm_choice, needs_fp32_gemm
from moescale.layers.moe import MoE


@dataclass(kw_only=True)
class LayerCase:
    """One benchmark shape."""

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    num_tokens: int

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_experts", "top_k", "num_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")




CASES = {
    "d512-e8": LayerCase(d_model=512, d_ff=2048, num_experts=8, num_tokens=8192),
    "d512-e64": LayerCase(d_model=512, d_ff=2048, num_experts=64, num_tokens=8192),
    "d1024-e16": LayerCase(d_model=1024, d_ff=4096, num_experts=16, num_tokens=4096),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("hf", "deepspeed")
SAVED_TARGET = 1.1
FLOOR_TIME_TARGET = 1.05     # moescale's step time at most this x the floor's
RSS_TARGET = 1.5             # moescale's peak RSS delta at most this x the dense floor's
EXPERTS = {"glu": ["glu"], "ffn": ["ffn"], "both": ["ffn", "glu"]}


@dataclass(kw_only=True)
class LayerBenchOptions:
    """What to run (plain data, validated)."""

    configs: list[str] = field(default_factory=lambda: list(CASES))
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    expert: str = "glu"                  # "glu": SiLU GLU (Mixtral); "ffn": GELU FFN; "both"
    memory: bool = True                  # peak RSS delta per implementation (own process)
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    repeats: int = 3
    warmup: int = 1
    quick: bool = False                  # tokens / 8, 2 repeats
    device: str = "cpu"
    slow_s: float = 60.0                 # a peer whose warm-up is slower gets 1 timed run
    lowp_peer_gflop: float = 0.6         # work per peer step where torch's low-p GEMM is slow
    batched_mm_bytes: int = 1 << 30      # cap on batched_mm's per-row weight copies
    seed: int = 0
    out: str | None = None

    def __post_init__(self) -> None:
        for name in self.configs:
            if name not in CASES:
                raise ValueError(f"--configs entry {name!r} is unknown; choose from "
                                 f"{', '.join(CASES)}")
        for name in self.dtypes:
            if name not in DTYPES:
                raise ValueError(f"--dtypes entry {name!r} is unknown; choose from "
                                 f"{', '.join(DTYPES)}")
        for name in self.peers:
            if name not in PEERS:
                raise ValueError(f"--peers entry {name!r} is unknown; choose from "
                                 f"{', '.join(PEERS)} (or --no-peers)")
        if self.expert not in EXPERTS:
            raise ValueError(f"--expert {self.expert!r} must be one of {', '.join(EXPERTS)}")
        if self.repeats < 1 or self.warmup < 1:
            raise ValueError(f"--repeats {self.repeats} and --warmup {self.warmup} must be >= 1")


def min_saved_bytes(num_tokens: int, num_rows: int, case: LayerCase, glu: bool,
                    dtype: torch.dtype) -> int:
    """What backward needs at least: x_TD, the hidden pre-activation(s) h_RF (h1 and h3 for
    GLU), the router's fp32 probabilities and the int64 token index of each row."""
    item = torch.tensor([], dtype=dtype).element_size()
    hidden = num_rows * case.d_ff * item * (2 if glu else 1)
    return num_tokens * case.d_model * item + hidden + num_tokens * case.num_experts * 4 \
        + num_rows * 8


def _peer_tokens(case: LayerCase, x: torch.Tensor, opts: LayerBenchOptions) -> tuple[int, str]:
    """Tokens a peer runs on: all, or fewer where torch's own low-precision GEMM is slow."""
    if not needs_fp32_gemm(x):
        return case.num_tokens, ""
    gemms = 9 if opts.expert == "glu" else 6
    per_token = 2 * gemms * case.d_model * case.d_ff * case.top_k
    tokens = max(4, min(case.num_tokens, int(opts.lowp_peer_gflop * 1e9 / per_token)))
    return tokens, (f"{tokens} tokens: torch's own {str(x.dtype)[6:]} GEMM on this CPU is "
                    "~150x slower than fp32; compare rows/s")


def build_candidates(case: LayerCase, dtype: torch.dtype, opts: LayerBenchOptions):
    device = torch.device(opts.device)
    torch.manual_seed(opts.seed)
    glu = opts.expert == "glu"
    moe = MoE(case.d_model, case.num_experts, case.top_k, d_ff=case.d_ff,
              activation="silu" if glu else "gelu", glu=glu).to(device, dtype)
    gen = torch.Generator().manual_seed(opts.seed + 1)
    x_TD = torch.randn(case.num_tokens, case.d_model, generator=gen).to(device, dtype)
    g_TD = torch.randn(case.num_tokens, case.d_model, generator=gen).to(device, dtype)
    rows = case.num_tokens * case.top_k
    out: list = [impls.build_floor(moe, rows, False, dtype, device, gen),
                 impls.build_floor(moe, rows, True, dtype, device, gen),
                 impls.build_moescale(moe, x_TD, g_TD),
                 impls.build_naive_loop(moe, x_TD, g_TD),
                 build_movement(moe, x_TD, g_TD)]
    peer_tokens, lowp_note = _peer_tokens(case, x_TD, opts)
    px_TD, pg_TD = impls.reduced_inputs(x_TD, g_TD, peer_tokens)
    if "hf" in opts.peers:
        for implementation in impls.HF_IMPLEMENTATIONS:
            tokens, note = peer_tokens, lowp_note
            if implementation == "batched_mm":
                item = x_TD.element_size() * (3 if glu else 2) * case.d_model * case.d_ff
                cap = max(1, opts.batched_mm_bytes // (item * case.top_k))
                if cap < tokens:
                    tokens = cap
                    note = (f"{tokens} tokens: batched_mm copies each row's expert weights "
                            f"({item * case.top_k * cap / 2**30:.1f} GiB here); compare rows/s")
            hx, hg = impls.reduced_inputs(x_TD, g_TD, tokens)
            out.append(_mark(impls.build_hf(moe, hx, hg, implementation, note), case))
    if "deepspeed" in opts.peers:
        for cf in (1.0, 2.0):
            out.append(_mark(impls.build_deepspeed(moe, px_TD, pg_TD, cf, lowp_note), case))
    return moe, out


def _mark(c, case: LayerCase):
    if isinstance(c, impls.Candidate) and c.tokens < case.num_tokens:
        c.reduced = True
    return c


def run_case(name: str, case: LayerCase, dtype_name: str, opts: LayerBenchOptions,
             log) -> tuple[list[dict], list[dict]]:
    dtype = DTYPES[dtype_name]
    log(f"\n== {name} {dtype_name}: T={case.num_tokens} D={case.d_model} F={case.d_ff} "
        f"E={case.num_experts} k={case.top_k} expert={opts.expert}")
    moe, built = build_candidates(case, dtype, opts)
    cands = [c for c in built if isinstance(c, impls.Candidate)]
    skipped = [{"config": name, "dtype": dtype_name, "expert": opts.expert, "impl": s.name,
                "reason": s.reason} for s in built if isinstance(s, impls.Skipped)]
    for s in skipped:
        log(f"  skipped {s['impl']}: {s['reason']}")
    timed = [Timed(name=c.name, step=c.step, reset=c.reset, runs=opts.repeats,
                   warmup=opts.warmup, exclude=c.params + c.loss_weights,
                   slow_s=opts.slow_s if c.family == "peer" else None) for c in cands]
    time_interleaved(timed, torch.device(opts.device), log, rotate=True)
    glu = opts.expert == "glu"
    rows = []
    for c, t in zip(cands, timed):
        median = t.median_s
        minimum = min_saved_bytes(c.tokens, c.rows, case, glu, dtype)
        rows.append(dict(
            config=name, dtype=dtype_name, expert=opts.expert, impl=c.name, family=c.family,
            tokens=c.tokens, rows=c.rows, median_ms=median * 1e3, min_ms=min(t.times_s) * 1e3,
            times_ms=[s * 1e3 for s in t.times_s], warmup_ms=[s * 1e3 for s in t.warmup_s],
            runs=len(t.times_s), tokens_per_s=c.tokens / median, rows_per_s=c.rows / median,
            saved_bytes=t.saved_bytes, min_saved_bytes=minimum,
            saved_ratio=t.saved_bytes / minimum if t.saved_bytes is not None else None,
            rss_delta_bytes=None, reduced=c.reduced, note=c.note,
            max_abs_diff=c.max_abs_diff, **c.extra))
    floor = max((r for r in rows if r["family"] == "floor"), key=lambda r: r["rows_per_s"])
    best_floor = min(r["min_ms"] / r["rows"] for r in rows if r["family"] == "floor")
    for r in rows:
        r["ratio_to_floor"] = r["rows_per_s"] / floor["rows_per_s"]
        r["ratio_to_floor_best_runs"] = best_floor / (r["min_ms"] / r["rows"])
        if r["family"] in ("moescale", "naive") and min(r["runs"], floor["runs"]) >= 2:
            # step time / the floor's over the paired repetitions (same rows per step)
            r["time_vs_floor"] = paired_ratio(r["times_ms"], floor["times_ms"]).as_dict()
    ours = next(r for r in rows if r["family"] == "moescale")
    naive = next(r for r in rows if r["family"] == "naive")
    if ours["runs"] >= 2 and naive["runs"] >= 2:
        ours["time_vs_naive"] = paired_ratio(ours["times_ms"], naive["times_ms"]).as_dict()
    ours["floor_plus_movement"] = movement_bound(rows, floor)
    del moe, built, timed
    if opts.memory:
        for c, r in zip(cands, rows):
            if r["family"] in ("floor", "moescale", "naive"):
                r["rss_delta_bytes"] = layer_memory.measure(c.name, c.family, case, dtype_name,
                                                            opts)
                if r["rss_delta_bytes"] is not None:
                    log(f"  {c.name:<28} peak RSS delta {r['rss_delta_bytes'] / 2**20:9.1f} MiB")
    return rows, skipped


def check_targets(rows: list[dict], case: LayerCase) -> list[dict]:
    """Targets of the issue for one (config, dtype, expert): one record each, pass/fail."""
    ours = next(r for r in rows if r["family"] == "moescale")
    time_ratio = 1.0 / ours["ratio_to_floor"]
    checks = [dict(what=f"moescale step time <= {FLOOR_TIME_TARGET} x floor (medians)",
                   value=time_ratio, ok=time_ratio <= FLOOR_TIME_TARGET,
                   interval=ours.get("time_vs_floor"), bound=ours.get("floor_plus_movement"))]
    for r in rows:
        if r["family"] in ("peer", "naive") and r is not ours:
            ratio = ours["rows_per_s"] / r["rows_per_s"]
            checks.append(dict(what=f"moescale faster than {r['impl']} (rows/s)", value=ratio,
                               ok=ratio > 1.0, dropless="capacity" not in r,
                               interval=ours.get("time_vs_naive") if r["family"] == "naive"
                               else None))
    if ours["saved_ratio"] is not None:
        checks.append(dict(what=f"moescale saved activations <= {SAVED_TARGET} x min",
                           value=ours["saved_ratio"], ok=ours["saved_ratio"] <= SAVED_TARGET))
    # the dense floor holds one expert's weight gradients, the split floor all E (as an MoE
    # must): both are reported, the second is the like-for-like one
    for r in rows:
        if r["family"] == "floor" and ours["rss_delta_bytes"] and r["rss_delta_bytes"]:
            ratio = ours["rss_delta_bytes"] / r["rss_delta_bytes"]
            which = "dense floor's" if r["impl"] == "floor: 1 dense FFN" else \
                "split floor's (same weight gradients)"
            checks.append(dict(what=f"moescale peak RSS delta <= {RSS_TARGET} x {which}",
                               value=ratio, ok=ratio <= RSS_TARGET))
    for c in checks:
        c.update(config=ours["config"], dtype=ours["dtype"], expert=ours["expert"])
    return checks


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<10} {'dtype':<5} {'exp':<3} {'implementation':<32} {'tokens':>6} "
            f"{'ms':>8} {'rows/s':>8} {'x floor':>7} {'saved MB':>8} {'x min':>5} "
            f"{'RSS MB':>7} {'runs':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        saved = "" if r["saved_bytes"] is None else f"{r['saved_bytes'] / 2**20:8.1f}"
        ratio = "" if r["saved_ratio"] is None else f"{r['saved_ratio']:5.2f}"
        rss = "" if r.get("rss_delta_bytes") is None else f"{r['rss_delta_bytes'] / 2**20:7.0f}"
        mark = "*" if r["reduced"] else ""
        lines.append(
            f"{r['config']:<10} {r['dtype']:<5} {r.get('expert', ''):<3} "
            f"{r['impl'] + mark:<32} {r['tokens']:>6} {r['median_ms']:8.1f} "
            f"{r['rows_per_s']:8.0f} {r['ratio_to_floor']:7.3f} {saved:>8} {ratio:>5} "
            f"{rss:>7} {r['runs']:>4}")
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    lines = ["| config | dtype | expert | implementation | tokens | rows | ms | rows/s | "
             "x floor | saved MiB | x min | peak RSS delta MiB |", "|" + "---|" * 12]
    for r in rows:
        saved = "" if r["saved_bytes"] is None else f"{r['saved_bytes'] / 2**20:.1f}"
        ratio = "" if r["saved_ratio"] is None else f"{r['saved_ratio']:.2f}"
        rss = "" if r.get("rss_delta_bytes") is None else f"{r['rss_delta_bytes'] / 2**20:.0f}"
        mark = " *" if r["reduced"] else ""
        lines.append(f"| {r['config']} | {r['dtype']} | {r.get('expert', '')} | "
                     f"{r['impl']}{mark} | {r['tokens']} | {r['rows']} | {r['median_ms']:.1f} | "
                     f"{r['rows_per_s']:.0f} | {r['ratio_to_floor']:.3f} | {saved} | {ratio} | "
                     f"{rss} |")
    return "\n".join(lines)


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "deepspeed"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional peers
            out[mod] = None
    return out


def run(opts: LayerBenchOptions, argv: list[str], log=print, on_partial=None) -> dict:
    """Run every (config, dtype); `on_partial(result)` gets the result so far after each."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available; use cpu")
    started = time.time()
    rows, skipped, checks = [], [], []
    created_group = False
    if "deepspeed" in opts.peers:
        try:
            import deepspeed  # noqa: F401
            created_group = impls.ensure_process_group()
        except Exception as err:  # noqa: BLE001 - report and go on without it
            log(f"deepspeed unavailable ({type(err).__name__}: {err}); skipping it")
    gemms = ", ".join(f"{d}: {c['kernels']}" for d, c in _gemm_choices(opts, device).items())
    log(f"CPU flags: {' '.join(cpu_flags()) or '(unknown)'}; {torch.get_num_threads()} "
        f"threads; GEMMs: {gemms}")
    try:
        for name, dtype_name, expert in ((n, d, x) for n in opts.configs for d in opts.dtypes
                                         for x in EXPERTS[opts.expert]):
            case = CASES[name]
            if opts.quick:
                case = LayerCase(**{**asdict(case),
                                    "num_tokens": max(64, case.num_tokens // 8)})
            case_rows, case_skipped = run_case(name, case, dtype_name,
                                               replace(opts, expert=expert), log)
            rows += case_rows
            skipped += case_skipped
            checks += check_targets(case_rows, case)
            log(format_table(case_rows))
            if on_partial is not None:
                on_partial(_result(opts, argv, device, started, rows, skipped, checks,
                                   complete=False))
    finally:
        if created_group:
            import torch.distributed as dist
            dist.destroy_process_group()
    return _result(opts, argv, device, started, rows, skipped, checks, complete=True)


def _gemm_choices(opts, device) -> dict:
    """Per dtype: the GEMM moescale's kernels (and the floor) use, decided once per process
    from what the CPU has, and what its flags alone would pick (lowp_gemm_choice)."""
    flags = cpu_flags()
    out = {}
    for d in opts.dtypes:
        x = torch.empty(1, dtype=DTYPES[d], device=device)
        out[d] = {"kernels": "fp32 emulation" if needs_fp32_gemm(x) else "native",
                  "by_flags": lowp_gemm_choice(DTYPES[d], flags) if flags else None,
                  "floor": impls.floor_gemm_name(x)}
    return out


def _result(opts, argv, device, started, rows, skipped, checks, complete: bool) -> dict:
    return dict(complete=complete,
        benchmark="layer", hardware=hardware_tag(device), versions=_versions(),
        cpu_flags=cpu_flags(), cpu_model=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(), command="moescale bench layer " + " ".join(argv),
        options={k: v for k, v in asdict(opts).items()}, gemm=_gemm_choices(opts, device),
        rss_meaning="peak RSS delta of one warm forward + backward in a fresh process "
                    "(layer_memory.py; glibc returns freed blocks >= 64 KiB at once): saved "
                    "activations, transients, weight gradients",
        loss="(y * g).sum() with a fixed random g",
        rows_meaning="routed rows computed per step (tokens x k dropless; kept choices under "
                     "a capacity factor; padding not counted)",
        min_saved_meaning="x_TD + h_RF (+ h3_RF for GLU) + fp32 router probs + int64 row index",
        seconds=time.time() - started, results=rows, skipped=skipped, targets=checks)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench layer", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CASES),
                   help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16,fp16")
    p.add_argument("--expert", default="glu", choices=tuple(EXPERTS),
                   help="glu: SiLU GLU experts as Mixtral (default); ffn: GELU FFN; both")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the peak RSS probes (one fresh process per implementation)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: hf,deepspeed")
    p.add_argument("--no-peers", action="store_true", help="floor and moescale only")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 3; quick 2)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed repetitions before the timed ones")
    p.add_argument("--quick", action="store_true", help="tokens / 8 and 2 repeats")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N")
    p.add_argument("--slow-s", type=float, default=60.0,
                   help="a peer whose warm-up takes longer is timed once (marked runs=1)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: runs/bench/<time>/layer_<hardware>[_quick].json; "
                        "benchmarks/results/... updates the recorded result)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the layers' weights and inputs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    split = [s.strip() for s in a.peers.split(",") if s.strip()]
    opts = LayerBenchOptions(
        configs=[s.strip() for s in a.configs.split(",") if s.strip()],
        dtypes=[s.strip() for s in a.dtypes.split(",") if s.strip()], expert=a.expert,
        peers=[] if a.no_peers else split,
        repeats=a.repeats if a.repeats is not None else (2 if a.quick else 3),
        warmup=a.warmup, quick=a.quick, device=a.device, slow_s=a.slow_s, seed=a.seed,
        out=a.out, memory=not a.no_memory)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if opts.out:
        path = Path(opts.out)
    else:
        suffix = "_quick" if opts.quick else ""
        if opts.configs != list(CASES) or opts.dtypes != ["fp32", "bf16"]:
            suffix += "_" + "-".join(opts.configs + opts.dtypes)
        if not opts.peers:
            suffix += "_nopeers"
        if opts.expert != "glu":
            suffix += "_" + opts.expert
        path = result_path(None, f"layer_{hardware_tag(torch.device(opts.device))}{suffix}.json")
    result = run(opts, argv, log, on_partial=lambda partial: write_json(path, partial))
    print("\n" + format_table(result["results"]))
    print("(* = measured on fewer tokens than the config; compare rows/s)")
    for s in result["skipped"]:
        print(f"skipped: {s['config']} {s['dtype']} {s['impl']}: {s['reason']}")
    print("\ntargets:")
    for c in result["targets"]:
        ci = c.get("interval")
        spread = f" (paired {ci['ratio']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}], " \
            f"n={ci['n']})" if ci else ""
        bound = c.get("bound")
        if bound:
            spread += f"; floor + routing and data movement alone: {bound['ratio']:.3f}"
        print(f"  [{'PASS' if c['ok'] else 'FAIL'}] {c['config']} {c['dtype']} {c['expert']}: "
              f"{c['what']}: {c['value']:.3f}{spread}")
    write_json(path, result)
    print(f"\nwrote {path}")
    return 0
