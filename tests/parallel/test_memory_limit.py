"""The pipelined dispatcher under a per-rank memory limit: chunks="auto" only runs chunk counts
at which something fits (more than the tuner's candidates when none of them does), a fixed
chunk count that cannot fit names the fewest that would, and `pipeline_choices` reports each
layer's pick.

The pure part checks the fitting functions and the tuner's `allowed`; the distributed part runs
2 real gloo ranks (tests/parallel/limit_workers.py), every call checked against the
single-process reference.

The peaks of the distributed cases (formula, D 8, F 12, 4 experts over 2 ranks, 9 tokens of
top-2 on the larger rank): lowest at 1 chunk 5424 bytes (S2/S4), 2 chunks 4624 (S2), 3 chunks
3888 (S2), 4 chunks 3888, 8 chunks 3232 (S4), 16 chunks 2768 (S4); unpipelined 5472.
"""

from __future__ import annotations

import pytest

from moescale.parallel.cost_model import Rates, choose_strategy
from moescale.parallel.groups import ParallelConfig
from moescale.parallel.launch import run_local
from moescale.parallel.memory_model import (MAX_CHUNKS, STRATEGY_NAMES, LayerShape,
                                            chunks_that_fit, lowest_peak,
                                            smallest_fitting_chunks)
from moescale.parallel.tuner import ChunkTuner, TunerConfig

from limit_workers import check_choices_record, check_limits

SHAPE = LayerShape(rows=18, rows_sent=18, tokens=9, d_model=8, d_ff=12, ep_size=2,
                   num_local_experts=2)
RATES = Rates(gemm_flops=1e9, a2a_latency_s=1e-4, a2a_bytes_per_s=1e9, copy_bytes_per_s=5e9)


def test_lowest_peak_and_the_chunk_counts_that_fit():
    assert lowest_peak(SHAPE, 4, STRATEGY_NAMES) == ("S2", 3888)
    assert lowest_peak(SHAPE, 1, ("none",), plain=True) == ("unpipelined", 5472)
    assert lowest_peak(SHAPE, 1, ("none",), plain=False) == ("none", 5856)
    cands = (1, 2, 4, 8)
    assert chunks_that_fit(SHAPE, None, cands, STRATEGY_NAMES) == cands
    assert chunks_that_fit(SHAPE, 5472, cands, STRATEGY_NAMES) == cands    # unpipelined fits
    assert chunks_that_fit(SHAPE, 4000, cands, STRATEGY_NAMES) == (4, 8)
    assert chunks_that_fit(SHAPE, 3000, cands, STRATEGY_NAMES) == (16,)    # beyond the list
    assert chunks_that_fit(SHAPE, 3300, cands, ("S4",), plain=False) == (8,)
    assert chunks_that_fit(SHAPE, 5000, cands, ("none",), plain=False) == (4, 8)
    with pytest.raises(ValueError, match=rf"memory_limit_bytes=1000 .* up to {MAX_CHUNKS} "
                                         r".*raise the limit to at least \d+ bytes"):
        chunks_that_fit(SHAPE, 1000, cands, STRATEGY_NAMES)
    assert smallest_fitting_chunks(SHAPE, 4000, STRATEGY_NAMES) == 3
    assert smallest_fitting_chunks(SHAPE, 4000, STRATEGY_NAMES, start=5) == 5
    assert smallest_fitting_chunks(SHAPE, 1000, STRATEGY_NAMES, max_chunks=32) is None
    with pytest.raises(ValueError, match="memory_limit_bytes=0 must be > 0"):
        ParallelConfig(memory_limit_bytes=0)
    # measured peaks replace the formula at their chunk count
    assert chunks_that_fit(SHAPE, 4000, cands, STRATEGY_NAMES,
                           peaks={4: {s: 9999 for s in STRATEGY_NAMES}}) == (8,)


def test_fixed_chunk_count_that_cannot_fit_names_the_fewest_that_would():
    with pytest.raises(ValueError, match=r"at chunks=2 .*use chunks=3 \(the fewest that fit\) "
                                         r"or chunks='auto'"):
        choose_strategy(SHAPE, RATES, 2, memory_limit_bytes=4000)
    with pytest.raises(ValueError, match=rf"no chunk count up to {MAX_CHUNKS} fits"):
        choose_strategy(SHAPE, RATES, 2, memory_limit_bytes=1000)
    name, table = choose_strategy(SHAPE, RATES, 3, memory_limit_bytes=4000)
    assert name == "S2" and all(row["peak_bytes"] <= 4000 for row in table if row["fits"])


def test_tuner_keeps_to_the_allowed_counts():
    tuner = ChunkTuner(TunerConfig(candidates=(1, 2, 4, 8), trials=1, warmup=2))
    allowed = (4, 8)
    seen = []
    for t in (9.0, 9.0, 2.0, 1.0, 5.0, 5.0):
        c = tuner.choose(3, allowed)
        seen.append(c)
        tuner.record(3, c, t)
    assert seen == [4, 4, 4, 8, 8, 8]          # warm-up at the fewest allowed, explore, best
    assert tuner.best(3) == 8 and tuner.converged(3, allowed) and not tuner.converged(3)
    assert tuner.choose(3, (16,)) == 16        # a count beyond the candidates is measured too
    tuner.record(3, 16, 0.5)
    assert tuner.samples[3][16] == [0.5] and tuner.choose(3, (8, 16)) == 16
    assert tuner.best(5, (4, 8)) == 4          # nothing measured: the fewest allowed
    with pytest.raises(ValueError, match="allowed=()"):
        tuner.choose(3, ())


CASES = [
    dict(name="auto/auto, 1 and 2 chunks do not fit", chunks="auto", strategy="auto",
         limit=4000, calls=4, allowed_chunks=(4, 8), allowed_strategies=("S2", "S4")),
    dict(name="auto/auto, no candidate fits: 16 chunks", chunks="auto", strategy="auto",
         limit=3000, calls=2, allowed_chunks=(16,), allowed_strategies=("S4",)),
    dict(name="auto chunks, fixed S4", chunks="auto", strategy="S4", limit=3300, calls=2,
         allowed_chunks=(8,), allowed_strategies=("S4",)),
    dict(name="auto/auto, a loose limit keeps 1 chunk", chunks="auto", strategy="auto",
         limit=10 ** 9, warmup=1, calls=1, allowed_chunks=(1,),
         allowed_strategies=STRATEGY_NAMES + ("unpipelined",)),
    dict(name="fixed 2 chunks under 4000", chunks=2, strategy="auto", limit=4000,
         expect_error="use chunks=3"),
    dict(name="auto under 1000", chunks="auto", strategy="auto", limit=1000,
         expect_error="raise the limit to at least"),
]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_auto_choices_fit_the_limit_on_two_ranks():
    cases = [dict(c, E=4, top_k=2, tokens=[9, 4]) for c in CASES]
    results = run_local(check_limits, 2, (cases,), timeout_s=20, deadline_s=80)
    assert results[0].value == results[1].value          # same choices (and errors) on both
    for case in CASES:
        got = results[0].value[case["name"]]
        if "expect_error" in case:
            assert got[0] == "raised" and case["expect_error"] in got[1], got
            continue
        _, calls, peaks = got
        assert len(calls) == case["calls"], got
        assert all(c in case["allowed_chunks"] and s in case["allowed_strategies"]
                   for c, s in calls), (case["name"], calls)
        assert all(p <= case["limit"] for p in peaks), (case["name"], peaks)
    explored = results[0].value[CASES[0]["name"]][1]
    assert [c for c, _ in explored] == [4, 4, 4, 8], explored   # warm-up 2, then 4 and 8


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_pipeline_choices_reports_each_pipelined_layer():
    results = run_local(check_choices_record, 2, timeout_s=20, deadline_s=50)
    assert results[0].value == results[1].value
    before, after = results[0].value
    assert before == {}
    assert set(after) == {"fixed", "auto"}                # static EP and uncalled: left out
    assert after["fixed"] == (2, "none")
    assert after["auto"][0] == 4 and after["auto"][1] in ("S2", "S4")
