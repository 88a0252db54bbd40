"""The pipelined all-to-all's real per-rank peak (resident set, 2 gloo ranks, fresh processes per
configuration) against the unpipelined dispatcher and against its formula, at a size where the
layer's buffers dominate the resident set (d_model 256, d_ff 1024, 8 experts, 2048 tokens of
top-2 per rank: 4 MiB per 4096 rows).

Each configuration runs `moescale.bench.ep_memory_rank.measure_config` (the benchmark's own
measurement: VmHWM around one forward + backward after a warm-up, glibc returning freed blocks)
and also compares outputs and gradients with the unpipelined dispatcher's.
"""

from __future__ import annotations

import pytest

from moescale.bench.ep_memory_rank import measure_config
from moescale.parallel.launch import run_local
from moescale.parallel.memory_model import (LayerShape, pipelined_peak_bytes,
                                            unpipelined_peak_bytes)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(180)]

ARGS = dict(tokens=2048, d_model=256, d_ff=1024, experts=8)
CONFIGS = [dict(chunks=0, strategy=None), dict(chunks=4, strategy="none"),
           dict(chunks=4, strategy="S4"), dict(chunks=8, strategy="S4")]


@pytest.mark.parametrize("glu", [False, True], ids=["ffn", "glu"])
def test_real_peak_follows_the_formula_and_reuse_lowers_it(tmp_path, glu):
    args = dict(ARGS, glu=glu, ref_dir=str(tmp_path))
    peaks = {}
    for config in CONFIGS:
        ranks = [r.value for r in run_local(measure_config, 2, (args, config), timeout_s=60,
                                            deadline_s=150)]
        for r in ranks:
            shape = LayerShape(rows=r["rows"], rows_sent=r["rows_sent"], tokens=r["tokens"],
                               d_model=256, d_ff=1024, glu=glu, ep_size=2, num_local_experts=4)
            formula = unpipelined_peak_bytes(shape) if not config["chunks"] else \
                pipelined_peak_bytes(shape, config["strategy"], config["chunks"])
            assert abs(formula - r["peak_bytes"]) <= 0.10 * r["peak_bytes"], (config, r, formula)
            assert r["max_rel_error"] <= 1e-5, (config, r["max_rel_error"])
        peaks[config["chunks"], config["strategy"]] = max(r["peak_bytes"] for r in ranks)
    base = peaks[0, None]
    assert peaks[4, "none"] <= base
    assert peaks[4, "S4"] <= 0.6 * base
    assert peaks[8, "S4"] < peaks[4, "S4"]
