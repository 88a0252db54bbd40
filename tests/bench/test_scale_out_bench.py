"""`moescale bench scale-out` on a tiny model with real gloo ranks.

Not a speed or memory verdict (the benchmark's own run gives those): checks that it runs end
to end through the bench CLI, measures both modes at every world size asked for, that the
sharded mode's dense bytes per rank are 1/N of the replicated (the pieces of the tiny model's
parameters divide evenly), times both modes the number of repetitions asked for, and writes
its JSON with the CPU flags and the paired interval; a bad option is refused before any rank
starts.
"""

from __future__ import annotations

import json

import pytest

from moescale.bench import cli

pytestmark = [pytest.mark.timeout(200), pytest.mark.slow]


def test_scale_out_measures_both_modes_and_writes_its_json(tmp_path):
    out = tmp_path / "scale_out.json"
    code = cli.main(["scale-out", "--d-model", "64", "--layers", "2", "--vocab", "256",
                     "--d-ff", "32", "--batch", "1", "--seq", "16", "--ranks", "2",
                     "--mem-steps", "1", "--runs", "2", "--warmup", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = {(r["ranks"], r["mode"]): r for r in report["memory"]}
    assert set(rows) == {(2, "replicate"), (2, "shard")}
    assert rows[2, "shard"]["ratio_to_replicated"] == pytest.approx(0.5)
    for r in rows[2, "shard"]["per_rank"]:
        assert r["dense_adamw_bytes"] == 2 * r["dense_param_bytes"] > 0
        assert r["steps_peak_rss_bytes"] > r["rss_before_model_bytes"] > 0
    times = report["step_time"]["times_s"]
    assert len(times["shard"]) == len(times["replicate"]) == len(times["ddp"]) == 2
    assert report["step_time"]["ratio_shard_to_replicate"]["n"] == 2
    assert report["step_time"]["ratio_ddp_to_replicate"]["n"] == 2
    assert report["step_time"]["ratio_shard_to_ddp"]["n"] == 2
    assert isinstance(report["cpu_flags"], list) and code == 0


def test_scale_out_refuses_a_width_that_is_not_a_multiple_of_64():
    with pytest.raises(ValueError, match="--d-model=100 must be a multiple of 64"):
        cli.main(["scale-out", "--d-model", "100"])


def test_scale_out_runs_0_measures_the_memory_only(tmp_path):
    out = tmp_path / "scale_out_memory.json"
    code = cli.main(["scale-out", "--d-model", "64", "--layers", "2", "--vocab", "256",
                     "--d-ff", "32", "--batch", "1", "--seq", "16", "--ranks", "2",
                     "--mem-steps", "1", "--runs", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {(r["ranks"], r["mode"]) for r in report["memory"]} == {(2, "replicate"),
                                                                    (2, "shard")}
    assert report["step_time"] is None and report["dense_within_target"] and code == 0


def test_scale_out_refuses_one_timed_run():
    with pytest.raises(ValueError, match=r"--runs=1 must be >= 2 \(the interval needs pairs\) "
                                         r"or 0 \(memory only\)"):
        cli.main(["scale-out", "--runs", "1"])
