"""The pipeline cost model (pure): kept-bytes accounting, per-rank peak formulas, time
prediction, strategy choice (never above the unpipelined dispatcher's peak)."""

import pytest

from moescale.layers.grouped_ffn import chunk_rows
from moescale.parallel.cost_model import (LayerShape, Rates, choose_strategy, memory_bytes,
                                          predict_seconds)
from moescale.parallel.memory_model import (STRATEGY_NAMES, pipelined_peak_bytes,
                                            pipeline_block_rows, unpipelined_peak_bytes)

SHAPE = LayerShape(rows=1000, d_model=64, d_ff=256, glu=True, elem_bytes=4, ep_size=4,
                   num_local_experts=2, host_is_device=False)
RATES = Rates(gemm_flops=1e11, a2a_latency_s=1e-4, a2a_bytes_per_s=1e9, copy_bytes_per_s=5e9)
# the issue's setting: 2 ranks, 4096 tokens of top-2 each, d 1024, d_ff 4096, 4 experts per rank
ISSUE = dict(rows=8192, rows_sent=8192, tokens=4096, d_model=1024, d_ff=4096, ep_size=2,
             num_local_experts=4)


def test_kept_bytes_accounting():
    di, h = 1000 * 64 * 4, 2 * 1000 * 256 * 4
    assert memory_bytes(SHAPE, "none", 4).device_total == di + h
    buf = 3 * 250 * 64 * 4
    assert [memory_bytes(SHAPE, s, 4).device_total for s in ("S1", "S2", "S3", "S4")] == \
        [buf] * 4
    assert [memory_bytes(SHAPE, s, 4).host for s in ("S1", "S2", "S3", "S4")] == \
        [di + h, di, h, 0]
    assert memory_bytes(SHAPE, "S4", 1).buffers == 1000 * 64 * 4   # one slot without chunks


@pytest.mark.parametrize("glu", [False, True])
def test_peak_formulas_in_the_issue_setting(glu):
    shape = LayerShape(glu=glu, **ISSUE)
    base = unpipelined_peak_bytes(shape)
    peak = {(s, c): pipelined_peak_bytes(shape, s, c) for s in STRATEGY_NAMES for c in (2, 4, 8)}
    assert all(peak[s, c] <= base for s, c in peak)          # chunking alone never costs
    assert peak["S4", 4] <= 0.60 * base and peak["S4", 8] < peak["S4", 4]
    assert peak["S2", 8] < peak["none", 8]                   # on a CPU, recompute saves H
    assert peak["S1", 4] == peak["none", 4]                  # ... and offloading saves nothing
    gpu = LayerShape(glu=glu, host_is_device=False, **ISSUE)
    assert pipelined_peak_bytes(gpu, "S1", 4) < peak["none", 4]   # on an accelerator it does
    # the weight gradients are in every peak; more tokens never lower it
    assert min(peak.values()) > shape.weight_bytes
    bigger = LayerShape(glu=glu, **{**ISSUE, "rows": 9000, "rows_sent": 9000})
    assert pipelined_peak_bytes(bigger, "S4", 4) >= peak["S4", 4]


def test_block_sizes_follow_the_kernels():
    assert chunk_rows(4096) == 1024 and pipeline_block_rows(4096) == 256
    assert pipeline_block_rows(10 ** 7) == 64


def test_prediction_and_choice():
    t1, t4 = (predict_seconds(SHAPE, RATES, "none", c).total_s for c in (1, 4))
    assert t4 < t1                                      # overlap pays when latency is small
    assert predict_seconds(SHAPE, RATES, "S1", 4).copy_s > 0
    on_cpu = LayerShape(**{**SHAPE.__dict__, "host_is_device": True})
    assert predict_seconds(on_cpu, RATES, "S1", 4).copy_s == 0   # nothing moves on a CPU
    base = unpipelined_peak_bytes(SHAPE)
    slow_copy = Rates(1e11, 1e-4, 1e9, 1e6)
    s4 = pipelined_peak_bytes(SHAPE, "S4", 4)
    name, table = choose_strategy(SHAPE, slow_copy, 4, memory_limit_bytes=s4)
    assert name in ("S2", "S4") and all(row["peak_bytes"] <= s4 for row in table if row["fits"])
    assert choose_strategy(SHAPE, RATES, 4)[0] == "none"  # no limit: nothing to recompute
    assert all(row["fits"] == (row["peak_bytes"] <= base) for row in
               choose_strategy(SHAPE, RATES, 4)[1])
    with pytest.raises(ValueError, match="below every strategy"):
        choose_strategy(SHAPE, RATES, 4, memory_limit_bytes=10)
    with pytest.raises(ValueError, match="rows=-1"):
        LayerShape(rows=-1, d_model=4, d_ff=4)


def test_measured_peaks_replace_the_formula_and_bound_the_choice():
    base = unpipelined_peak_bytes(SHAPE)
    # measured: `none` at 4 chunks above the unpipelined dispatcher -> never picked
    name, table = choose_strategy(SHAPE, RATES, 4, peaks={"none": base + 1, "S1": base + 1})
    assert name not in ("none", "S1")
    assert {row["strategy"]: row["measured"] for row in table}["none"] is True
    # nothing pipelined fits under the measured unpipelined peak: the plain dispatcher
    over = {s: base + 1 for s in STRATEGY_NAMES}
    assert choose_strategy(SHAPE, RATES, 4, peaks=over)[0] == "unpipelined"
    with pytest.raises(ValueError, match="below every strategy"):
        choose_strategy(SHAPE, RATES, 4, memory_limit_bytes=base - 1, peaks=over)
