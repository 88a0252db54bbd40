"""The quality benchmark end to end at a toy budget: both models train, JSON is written."""

from __future__ import annotations

import json

import pytest

from moescale.bench.quality import main


@pytest.mark.timeout(120)
def test_quality_bench_writes_both_losses(tmp_path, capsys):
    assert main(["--seconds", "0.3", "--batch-size", "2", "--seq-len", "16",
                 "--eval-batches", "1", "--warmup-steps", "1", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quality_*.json")
    result = json.loads(path.read_text())
    moe, dense = result["moe"], result["dense"]
    assert moe["model"]["moe_every"] == 1 and dense["model"]["moe_every"] == 0
    assert dense["model"]["d_ff"] == moe["model"]["top_k"] * moe["model"]["d_ff"]
    # same active parameters up to the router's gate (d_model x num_experts per MoE layer)
    gate = moe["model"]["n_layers"] * moe["model"]["d_model"] * moe["model"]["num_experts"]
    assert moe["params_active"] - dense["params_active"] == gate
    assert moe["steps"] >= 1 and dense["steps"] >= 1
    assert moe["val_loss"] > 0 and dense["val_loss"] > 0
    assert "MoE" in capsys.readouterr().out
