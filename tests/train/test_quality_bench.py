"""The quality benchmark end to end at a toy budget: both models train, JSON is written.

Two seeds (one MoE/dense pair each), the per-seed difference and its spread, the
loss-vs-wall-clock curve, and recipe overrides (top-1 routing: the dense twin's FFN width
follows top_k; fine-grained experts: it follows the expert width; a learning rate for the MoE
alone)."""

from __future__ import annotations

import json

import pytest

from moescale.bench.quality import main

TOY = ["--seconds", "0.3", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
       "--curve-points", "2", "--curve-batches", "1", "--warmup-steps", "1", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quality_bench_writes_both_losses_for_two_seeds(tmp_path, capsys):
    assert main(TOY + ["--seeds", "1,2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quality_*.json")
    result = json.loads(path.read_text())
    assert result["seeds"] == [1, 2] and len(result["runs"]) == 2 and result["complete"]
    for run in result["runs"]:
        moe, dense = run["moe"], run["dense"]
        assert moe["model"]["moe_every"] == 1 and dense["model"]["moe_every"] == 0
        assert dense["model"]["d_ff"] == moe["model"]["top_k"] * moe["model"]["d_ff"]
        # same active parameters up to the router's gate (d_model x num_experts per MoE layer)
        gate = moe["model"]["n_layers"] * moe["model"]["d_model"] * moe["model"]["num_experts"]
        assert moe["params_active"] - dense["params_active"] == gate
        assert moe["steps"] >= 1 and dense["steps"] >= 1
        assert moe["val_loss"] > 0 and dense["val_loss"] > 0
        assert 1 <= len(moe["curve"]) <= 2 and moe["curve"][-1]["val_loss"] > 0
        assert run["moe_minus_dense"] == pytest.approx(moe["val_loss"] - dense["val_loss"])
    spread = result["moe_minus_dense"]
    assert spread["n"] == 2 and spread["min"] <= spread["mean"] <= spread["max"]
    assert "MoE - dense" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quality_recipe_override_and_bad_seeds(tmp_path):
    assert main(TOY + ["--seeds", "3", "--top-k", "1", "--experts", "4", "--lr", "0.002",
                       "--tag", "k1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / next(p.name for p in tmp_path.glob("quality_*_k1.json")))
                        .read_text())
    moe, dense = result["runs"][0]["moe"], result["runs"][0]["dense"]
    assert moe["model"]["top_k"] == 1 and moe["model"]["num_experts"] == 4
    assert dense["model"]["d_ff"] == moe["model"]["d_ff"]
    with pytest.raises(ValueError, match="--seeds"):
        main(TOY + ["--seeds", "a,b"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quality_fine_grained_experts_and_moe_lr(tmp_path):
    assert main(TOY + ["--seeds", "5", "--top-k", "2", "--experts", "4", "--expert-ff", "64",
                       "--lr", "0.002", "--moe-lr", "0.004", "--tag", "fg",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quality_*_fg.json")
    result = json.loads(path.read_text())
    assert result["recipe"]["moe_lr"] == 0.004 and result["recipe"]["expert_ff"] == 64
    moe, dense = result["runs"][0]["moe"], result["runs"][0]["dense"]
    assert moe["model"]["d_ff"] == 64 and dense["model"]["d_ff"] == 2 * 64
    assert moe["lr"] == 0.004 and dense["lr"] == 0.002
