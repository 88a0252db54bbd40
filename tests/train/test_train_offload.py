"""`moescale train` with offloaded experts, in process: the host and disk tiers train the same
losses as device-only training (fp32, relative 1e-5), a run stopped halfway and resumed logs
exactly the uninterrupted run's numbers (the experts' shard is part of the checkpoint), the
summary reports the simulated device's peak (within its budget), the disk bytes and the plan,
and `offload.mode auto` reports the planner's pick."""

from __future__ import annotations

import json

import pytest

from moescale.train.checkpoint import list_checkpoints
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import tiny_run_config

STEPS = 8


def _config(corpus, run_dir, **extra):
    return tiny_run_config(corpus, run_dir, steps=STEPS, every=4, keep_last=1, **extra)


def _records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("train", "val")]


@pytest.fixture(scope="module")
def device_only(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("device_only") / "run"
    assert Trainer(_config(corpus, run_dir), run_dir, out=open("/dev/null", "w")).run() == 0
    return _records(run_dir)


@pytest.mark.parametrize("mode, extra", [
    ("host", {"offload.device_budget_experts": "2", "offload.activation_policy": "recompute"}),
    ("disk", {"offload.host_cache": "192KiB", "train.grad_accum": "2"}),
])
def test_offloaded_training_matches_device_only_and_resumes_exactly(
        mode, extra, corpus, device_only, tmp_path):
    options = {"offload.mode": mode, **extra}
    straight_dir = tmp_path / "straight"
    straight = Trainer(_config(corpus, straight_dir, **options), straight_dir,
                       out=open("/dev/null", "w"))
    assert straight.run() == 0
    summary = json.loads((straight_dir / "summary.json").read_text())
    memory = summary["memory"]
    assert 0 < memory["device_peak_bytes"] <= memory["device_budget_bytes"]
    assert summary["offload_plan"] == mode
    if mode == "disk":
        assert memory["disk_bytes"] > 0 and memory["disk_read_bytes"] > 0
        assert (straight_dir / "expert-store").is_dir()
    # the same numbers as all-resident training (grad_accum changes the device-only run)
    got = _records(straight_dir)
    if "train.grad_accum" not in extra:
        assert len(got) == len(device_only)
        for a, b in zip(got, device_only):
            for key in ("loss", "val_loss", "grad_norm"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a["step"])
            assert a.get("tokens_per_expert") == b.get("tokens_per_expert")
    # stop at step 4, resume in a new Trainer: exactly the straight run's records
    run_dir = tmp_path / "resumed"
    first = Trainer(_config(corpus, run_dir, **options), run_dir, out=open("/dev/null", "w"))
    assert first.run(until_step=STEPS // 2) == 0
    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert [s for s, _ in ckpts] == [0, STEPS // 2]     # the initial state: trust.py
    shards = run_dir / "checkpoints" / f"expert-shards-{STEPS // 2:08d}"
    assert (shards / "rank00000" / "index.json").is_file()
    second = Trainer(_config(corpus, run_dir, **options), run_dir, resume=True,
                     out=open("/dev/null", "w"))
    assert second.step == STEPS // 2
    assert second.run() == 0
    for a, b in zip(_records(run_dir), got, strict=True):
        for key in ("loss", "val_loss", "grad_norm", "lr", "tokens_per_expert"):
            assert a.get(key) == b.get(key), (key, a["step"])
    # keep_last 1 at the end of a run: the old expert shards went with their checkpoints
    stores = sorted(p.name for p in (run_dir / "checkpoints").glob("expert-shards-*"))
    assert stores == [f"expert-shards-{STEPS:08d}"]


def _auto_run(corpus, run_dir, budget: str, steps: str) -> Trainer:
    """A finished run of tier auto with ES-MoE's A100 rates and this device budget."""
    config = _config(corpus, run_dir, **{"offload.mode": "auto", "offload.device_budget": budget,
                                         "offload.rates": "a100", "train.steps": steps})
    trainer = Trainer(config, run_dir, out=open("/dev/null", "w"))
    assert trainer.run() == 0
    return trainer


def test_auto_mode_reports_the_planner_pick(corpus, tmp_path):
    run_dir = tmp_path / "auto"
    trainer = _auto_run(corpus, run_dir, "4MiB", "2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["offload_plan"].startswith("auto:")
    assert "planner picked" in trainer.plan_text
    assert summary["memory"]["device_peak_bytes"] <= 4 * 2**20


def test_auto_mode_says_what_a_device_pick_runs(corpus, tmp_path):
    """The planner's 'device' mode (all expert state on the device, device AdamW) runs as the
    host tier with every expert pinned: the plan line says so, not just 'picked device'."""
    trainer = _auto_run(corpus, tmp_path / "auto-device", "256MiB", "1")
    assert "planner picked 'device'" in trainer.plan_text
    assert "runs as the host tier with every expert's compute copy pinned on the device" \
        in trainer.plan_text and "hottest 100% pinned" in trainer.plan_text


def test_eager_steps_without_clipping(corpus, device_only, tmp_path):
    run_dir = tmp_path / "eager"
    config = _config(corpus, run_dir, **{"offload.mode": "host", "offload.step_mode": "eager",
                                         "optim.grad_clip": "0", "train.steps": "3"})
    assert Trainer(config, run_dir, out=open("/dev/null", "w")).run() == 0
    records = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert len(records) == 3 and all(r["grad_norm"] is None for r in records)


def test_disk_tier_refuses_at_start_when_checkpoints_would_not_fit(corpus, tmp_path):
    """Experts on the meta device (nothing allocated) whose state is far larger than the free
    disk: refused before any file is written, naming the space needed and the way out."""
    run_dir = tmp_path / "big"
    cfg = _config(corpus, run_dir, **{"offload.mode": "disk", "model.d_model": "2048",
                                      "model.d_ff": "65536", "model.num_experts": "64",
                                      "model.n_layers": "2", "model.n_heads": "4"})
    with pytest.raises(ValueError) as err:
        Trainer(cfg, run_dir, out=open("/dev/null", "w")).run()
    message = str(err.value)
    assert "offload.tier='disk' needs" in message and "GiB are free" in message
    assert "train.checkpoint_interval 0" in message and "\n" not in message
    assert not list((run_dir / "expert-store").rglob("*.bin"))
