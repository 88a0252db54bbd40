"""`moescale bench offload` and `moescale bench plan-check` machinery on tiny cases.

Not speed tests: checks that the host-tier benchmark times the null control and every
configuration the asked number of times and writes per-configuration medians, paired ratios
with intervals, the null-control target and the CPU flags; and that the plan check measures its
rates, runs a host and a disk configuration (the disk bytes per step predicted and counted),
and compares a second run with the first. No assertion depends on a timing."""

from __future__ import annotations

import json

import pytest

from moescale.bench import offload, plan_check
from moescale.bench.disk_probe import cpu_flags

TINY = ["--layers", "1", "--d-model", "16", "--d-ff", "32", "--experts", "4", "--tokens", "32"]


@pytest.mark.slow
def test_offload_bench_reports_ratios_with_intervals_and_a_null_control(tmp_path, capsys):
    out = tmp_path / "offload.json"
    assert offload.main([*TINY, "--runs", "3", "--budgets", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    names = [r["name"] for r in res["results"]]
    assert names == ["resident", "resident-copy", "host-b2-eager", "host-b2-deferred"]
    assert res["cpu_flags"] == cpu_flags()
    for r in res["results"]:
        assert len(r["times_s"]) == 3 and len(r["warmup_s"]) == 1
        if r["name"] == "resident":
            assert r["ratio"] is None
        else:
            ci = r["ratio"]
            assert ci["n"] == 3 and ci["low"] <= ci["ratio"] <= ci["high"]
    targets = {t["name"]: t for t in res["targets"]}
    assert "null control: resident-copy interval contains 1.0" in targets
    assert sum(name.startswith("host-b2-") for name in targets) == 2
    assert "null control" in capsys.readouterr().out


def test_offload_bench_needs_two_runs():
    with pytest.raises(ValueError, match="--runs"):
        offload.main([*TINY, "--runs", "1"])


@pytest.mark.slow
def test_plan_check_host_and_disk_rows_and_the_comparison_with_a_previous_run(tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--configs", "host:1:16:32:4:32,disk:2:48:200:4:64", "--runs", "2",
            "--disk-runs", "2", "--warmup", "1", "--disk-probe-mb", "8", "--host-cache-gb", "0.002", "--dir", str(tmp_path),
            "--out", str(out)]
    assert plan_check.main(argv) == 0
    first = json.loads(out.read_text())
    host, disk = first["results"]
    assert (host["tier"], disk["tier"]) == ("host", "disk")
    assert first["cpu_flags"] == cpu_flags()
    assert len(host["rates"]["samples"]["flops_per_s"]) == 2       # the warm-up is dropped
    assert "disk_read_bytes_per_s" not in host["rates"]["samples"]
    probe = disk["rates"]["samples"]
    assert probe["disk"]["file_bytes"] == 8 << 20 and len(probe["disk_read_bytes_per_s"]) == 2
    assert len(probe["disk"]["device_bytes_per_pass"]) == 2 * 3    # write + read per round
    assert disk["predicted_bytes_per_step"]["written"] > 0
    assert disk["bytes_per_step"]["store_written"] > 0
    assert not any("previous run" in t["name"] for t in first["targets"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]   # no store left
    assert plan_check.main(argv) == 0                     # compares with the file it wrote
    second = json.loads(out.read_text())
    assert sum("previous run" in t["name"] for t in second["targets"]) == 2
    assert "predicted_change" in second["results"][0]["previous_run"]


def test_plan_check_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="--dir"):
        plan_check.main(["--dir", str(tmp_path / "absent"), "--out", str(tmp_path / "p.json")])


def test_plan_check_rejects_an_unknown_configuration():
    with pytest.raises(ValueError, match="tier:layers:d_model:d_ff:experts:tokens"):
        plan_check._config("gpu:1:2:3")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_offload_disk_bench_on_a_small_model_runs_formats_and_leaves_dir_empty(tmp_path):
    """A model whose records are smaller than dd's request (the probe divided by zero), two
    formats back to back: bytes per parameter per format, each step's loss, the expert files
    removed from --dir afterwards (they were left there: 24 GB in one run)."""
    from moescale.bench import offload_disk
    where, out = tmp_path / "dir", tmp_path / "disk.json"
    where.mkdir()
    argv = [*TINY, "--steps", "2", "--probe-gb", "0.01", "--host-cache-gb", "0.001",
            "--formats", "fp32+fp32,bf16+int8", "--dir", str(where), "--out", str(out)]
    assert offload_disk.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["format"] for r in res["runs"]] == ["master=fp32,moments=fp32",
                                                  "master=bf16,moments=int8"]
    for run in res["runs"]:
        assert run["device_bytes_per_param_per_step"] >= 0
        assert all(s["loss"] == s["loss"] for s in run["result"]["steps"])   # finite, recorded
    assert list(where.iterdir()) == []
    assert offload_disk.main([*TINY, "--formats", "fp32+int4", "--out", str(out)]) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_offload_disk_bench_times_verified_reads_on_and_off_on_one_store(tmp_path, capsys):
    """--verify-ab: twice the timed steps, verified reads on, off, off, on (the same store);
    the on steps hash what they read, the off steps nothing; medians and their ratio."""
    from moescale.bench import offload_disk
    out = tmp_path / "disk.json"
    argv = [*TINY, "--steps", "2", "--probe-gb", "0.01", "--host-cache-gb", "0.00005",
            "--formats", "fp32+fp32", "--verify-ab", "--out", str(out)]
    assert offload_disk.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    timed = [s for s in run["result"]["steps"] if not s["warmup"]]
    assert [s["verify"] for s in timed] == [True, False, False, True]
    assert all(s["bytes_verified"] == s["bytes_read"] > 0 for s in timed if s["verify"])
    assert all(s["bytes_verified"] == 0 and s["bytes_read"] > 0
               for s in timed if not s["verify"])
    ab = run["verify_ab"]
    assert ab["steps_each"] == 2 and ab["on_over_off"] == ab["on_median_s"] / ab["off_median_s"]
    assert "verified reads      on" in capsys.readouterr().out
