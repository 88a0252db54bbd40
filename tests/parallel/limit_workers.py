"""Rank bodies for the memory-limit tests of the pipelined dispatcher (run under run_local).

Each case builds the single-process MoE and its reference (tests/parallel/ep_workers.py), shards
it with a `PipelinedExpertParallelDispatcher` under a per-rank peak limit, and either runs a few
calls (each checked against the reference: output, input gradient, router gradient) recording
what `pipeline_choices` reports, or expects the first call to raise a ValueError (returned as
text, so the test reads the message).
"""

from __future__ import annotations

from torch import nn

from moescale.parallel.choices import pipeline_choices
from moescale.parallel.expert_parallel import shard_moe
from moescale.parallel.groups import ParallelConfig, build_groups
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher
from moescale.parallel.tuner import TunerConfig

from ep_workers import _full_moe, _inputs, _reference, check_layer


def _dispatcher(groups, case: dict) -> PipelinedExpertParallelDispatcher:
    return PipelinedExpertParallelDispatcher(
        groups, case["E"], num_chunks=case["chunks"], strategy=case["strategy"],
        memory_limit_bytes=case.get("limit"),
        tuner=TunerConfig(trials=1, warmup=case.get("warmup", 2)))


def check_limits(rank: int, world: int, cases: list[dict]) -> dict:
    """{case name: ("ran", [(chunks, strategy) per call], [peak of the pick per call]) or
    ("raised", message)}."""
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    out = {}
    for case in cases:
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, groups.ep_size)
        model = nn.ModuleDict({"moe": shard_moe(full, groups, _dispatcher(groups, case))})
        moe = model["moe"]
        if case.get("expect_error"):
            try:
                moe(xs[rank].clone())
            except ValueError as exc:
                out[case["name"]] = ("raised", str(exc))
                continue
            raise AssertionError(f"{case['name']}: the first call did not raise")
        calls, peaks = [], []
        for _ in range(case.get("calls", 1)):
            moe.zero_grad(set_to_none=True)
            check_layer(moe, full, case, xs, cs, y_ref, gx_ref, rank, groups)
            calls.append(tuple(pipeline_choices(model)["moe"]))
            table = moe.dispatcher.last_stats["strategy_table"]
            if table is not None:
                peaks.append(next(row["peak_bytes"] for row in table
                                  if row["strategy"] == calls[-1][1]))
        out[case["name"]] = ("ran", calls, peaks)
    return out


def check_choices_record(rank: int, world: int) -> tuple[dict, dict]:
    """pipeline_choices over a model of four layers: pipelined fixed, pipelined auto under a
    limit, static EP, pipelined never called. Returns (before any call, after one call each)."""
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    base = dict(E=2 * world, top_k=2)
    fixed = dict(base, chunks=2, strategy="none")
    auto = dict(base, chunks="auto", strategy="auto", limit=4000)
    model = nn.ModuleDict({
        "fixed": shard_moe(_full_moe(base), groups, _dispatcher(groups, fixed)),
        "auto": shard_moe(_full_moe(base), groups, _dispatcher(groups, auto)),
        "static": shard_moe(_full_moe(base), groups),
        "idle": shard_moe(_full_moe(base), groups, _dispatcher(groups, fixed)),
    })
    xs, _ = _inputs(dict(base, tokens=[9, 4, 7, 5][:world]), world)
    before = pipeline_choices(model)
    for name in ("fixed", "auto", "static"):
        model[name](xs[rank].clone().requires_grad_(True)).sum().backward()
    return before, {k: tuple(v) for k, v in pipeline_choices(model).items()}
