"""torch.compile over a MoE layer: the breaks left are the data-dependent ones of dropless
routing (per-expert counts sized on the host); moescale's own CPU-thread bookkeeping
(`os.sched_getaffinity`, torch's thread count) is no longer traced into the forward."""

from __future__ import annotations

import warnings

import pytest
import torch

import moescale


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_graph_break_comes_from_the_cpu_thread_budget():
    dynamo = pytest.importorskip("torch._dynamo")
    torch.manual_seed(0)
    moe = moescale.MoE(d_model=32, num_experts=4, top_k=2, d_ff=64)
    x = torch.randn(2, 16, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = dynamo.explain(moe)(x)
    frames = [f.filename for r in explained.break_reasons for f in r.user_stack]
    assert not [f for f in frames if f.endswith("expert_threads.py")], frames
    assert not [w for w in caught if "sched_getaffinity" in str(w.message)]
