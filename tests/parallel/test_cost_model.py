"""The pipeline cost model (pure): memory formulas, time prediction, strategy choice."""

import pytest

from moescale.parallel.cost_model import (LayerShape, Rates, choose_strategy, memory_bytes,
                                          predict_seconds)

SHAPE = LayerShape(rows=1000, d_model=64, d_ff=256, glu=True, elem_bytes=4, ep_size=4)
RATES = Rates(gemm_flops=1e11, a2a_latency_s=1e-4, a2a_bytes_per_s=1e9, copy_bytes_per_s=5e9)


def test_memory_formulas():
    di, h = 1000 * 64 * 4, 2 * 1000 * 256 * 4
    assert memory_bytes(SHAPE, "none", 4).device_total == di + h
    buf = 2 * 250 * 64 * 4
    assert [memory_bytes(SHAPE, s, 4).device_total for s in ("S1", "S2", "S3", "S4")] == \
        [buf] * 4
    assert [memory_bytes(SHAPE, s, 4).host for s in ("S1", "S2", "S3", "S4")] == \
        [di + h, di, h, 0]
    assert memory_bytes(SHAPE, "S4", 1).buffers == 1000 * 64 * 4   # one slot without chunks
    assert memory_bytes(SHAPE, "S4", 4).device_total <= 0.55 * memory_bytes(SHAPE, "none", 1) \
        .device_total


def test_prediction_and_choice():
    t1, t4 = (predict_seconds(SHAPE, RATES, "none", c).total_s for c in (1, 4))
    assert t4 < t1                                      # overlap pays when latency is small
    slow_copy = Rates(1e11, 1e-4, 1e9, 1e6)
    name, table = choose_strategy(SHAPE, slow_copy, 4, memory_limit_bytes=200_000)
    assert name == "S4" and {row["strategy"] for row in table if row["fits"]} == \
        {"S1", "S2", "S3", "S4"}
    assert choose_strategy(SHAPE, RATES, 4)[0] == "none"  # no limit: nothing to recompute
    with pytest.raises(ValueError, match="below every strategy"):
        choose_strategy(SHAPE, RATES, 4, memory_limit_bytes=10)
    with pytest.raises(ValueError, match="rows=-1"):
        LayerShape(rows=-1, d_model=4, d_ff=4)
