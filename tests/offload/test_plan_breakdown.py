"""`moescale plan`'s step-time breakdown, its dense and vocabulary options, and its tie-break
(moescale/offload/planner.py): the parts' added times sum to each mode's step in every timing
regime; equally fast modes go to the one using less device memory (ES-MoE's setting at A100
rates: pin and host both wait on the host AdamW, host holds 13.5 GiB less on the device);
vocabulary and dense parameters cost exactly their weights, AdamW state and logits."""

from __future__ import annotations

import dataclasses

import pytest

from moescale.offload.plan_cli import main
from moescale.offload.planner import (A100_NODE, MODES, Budgets, ModelSpec, estimate, plan)

GIB = 1 << 30
ESMOE = dict(moe_layers=24, d_model=1536, d_ff=6144, num_experts=64, tokens=8192)
BUDGETS = Budgets(device_bytes=40 * GIB, host_bytes=512 * GIB, disk_bytes=4096 * GIB)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("step_mode", ["eager", "deferred"])
@pytest.mark.parametrize("spec", [ESMOE, dict(moe_layers=2, d_model=256, d_ff=512,
                                               num_experts=8, tokens=64, micro_batches=3,
                                               glu=True, dtype="float32")])
def test_the_added_times_sum_to_the_step(spec, step_mode, overlap):
    rates = dataclasses.replace(A100_NODE, overlap=overlap)
    for cache in (None, GIB):
        budgets = dataclasses.replace(BUDGETS, host_cache_bytes=cache)
        for mode in MODES:
            e = estimate(ModelSpec(**spec), budgets, rates, mode, step_mode=step_mode)
            added = sum(a for _, a in e.breakdown.values())
            assert added == pytest.approx(e.step_s, rel=1e-12)
            assert all(0 <= a <= w * (1 + 1e-12) for w, a in e.breakdown.values())
            assert {"dense compute", "expert compute"} <= set(e.breakdown)
            assert ("disk reads" in e.breakdown) == (mode == "disk")
            assert ("host AdamW" in e.breakdown) == (mode != "device")
            if not overlap:   # a CPU "device": only the disk's own threads hide anything
                assert all(a == pytest.approx(w) for name, (w, a) in e.breakdown.items()
                           if not name.startswith("disk"))


def test_equally_fast_modes_go_to_the_one_with_less_device_memory():
    ests, pick = plan(ModelSpec(**ESMOE), BUDGETS, A100_NODE)
    by = {e.mode: e for e in ests}
    assert round(by["pin"].step_s, 6) == round(by["host"].step_s, 6)   # both AdamW-bound
    assert by["host"].device_bytes < by["pin"].device_bytes - 13 * GIB
    assert pick == "host"
    # a real speed difference still wins over memory: a deferred step pays uploads in full
    ests, pick = plan(ModelSpec(**ESMOE), BUDGETS, A100_NODE, step_mode="deferred")
    assert {e.mode: e for e in ests}["pin"].step_s < {e.mode: e for e in ests}["host"].step_s
    assert pick == "pin"


def test_vocabulary_and_dense_parameters_count_on_the_device_and_in_the_step():
    base = ModelSpec(**ESMOE, dense_params=10**8)
    vocab = ModelSpec(**ESMOE, dense_params=10**8, vocab_size=50257)
    untied = ModelSpec(**ESMOE, dense_params=10**8, vocab_size=50257, tie_embeddings=False)
    assert untied.vocab_params == 2 * vocab.vocab_params == 2 * 50257 * 1536
    logits = 8192 * 50257 * (2 + 4)           # bf16 logits + fp32 log-softmax
    for mode in MODES:
        a, b, c = (estimate(s, BUDGETS, A100_NODE, mode) for s in (base, vocab, untied))
        assert b.device_bytes - a.device_bytes == vocab.vocab_params * (16 + 2) + logits
        assert c.device_bytes - b.device_bytes == vocab.vocab_params * (16 + 2)
        head_s = 6 * 8192 * 50257 * 1536 / A100_NODE.flops_per_s   # the head GEMM only
        assert b.breakdown["dense compute"][0] - a.breakdown["dense compute"][0] == \
            pytest.approx(head_s)
        assert c.breakdown["dense compute"] == b.breakdown["dense compute"]
        assert b.host_bytes == a.host_bytes and b.disk_bytes == a.disk_bytes
    with pytest.raises(ValueError, match="vocab_size=-1"):
        ModelSpec(**ESMOE, vocab_size=-1)


def test_plan_command_prints_the_breakdown_and_takes_the_dense_options(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "pick: host" in out and "step time by part" in out
    for part in ("dense compute", "expert compute", "uploads", "host AdamW", "disk reads"):
        assert part in out
    assert main(["--dense-params", "100000000", "--vocab-size", "50257",
                 "--untied-embeddings"]) == 0
    out = capsys.readouterr().out
    assert "dense 100,000,000 + vocabulary 154,389,504 parameters" in out
