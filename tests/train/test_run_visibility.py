"""What a run shows about itself: wait_s in every metrics record (offloaded runs: >= 0 and
within the step's time, summed in the summary with its share; resident runs: 0.0), TensorBoard
event files read back with TensorBoard's own reader (tags and step counts; a clear refusal
without the package), and report.png's panels (aux loss, grad norm, load imbalance, wait)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from moescale.train.metrics import read_metrics
from moescale.train.report import _series, write_report
from moescale.train.tensorboard_log import TRAIN_TAGS, ScalarLog
from moescale.train.trainer import Trainer
from train_helpers import resume_copy, tiny_run_config

STEPS = 6


def _run(corpus, run_dir, **extra):
    config = tiny_run_config(corpus, run_dir, steps=STEPS, every=3, keep_last=2, **extra)
    assert Trainer(config, run_dir, out=open("/dev/null", "w")).run() == 0
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    return train, json.loads((run_dir / "summary.json").read_text())


def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {"offload.tier": "host", "offload.device_budget_experts": "2"},
    {"offload.tier": "disk", "offload.host_cache_bytes": "192KiB"},
], ids=["host", "disk"])
def test_offloaded_runs_log_their_wait_within_the_step_time(corpus, tmp_path, extra):
    train, summary = _run(corpus, tmp_path / "run", **extra)
    assert len(train) == STEPS
    for r in train:
        step_s = r["tokens"] / r["tokens_per_s"]
        assert 0.0 <= r["wait_s"] <= step_s, (r["step"], r["wait_s"], step_s)
    assert any(r["wait_s"] > 0 for r in train)       # the uploads were measured
    assert summary["wait_s"] == pytest.approx(sum(r["wait_s"] for r in train))
    step_time = sum(r["tokens"] / r["tokens_per_s"] for r in train)
    assert summary["wait_share"] == pytest.approx(summary["wait_s"] / step_time)
    assert 0.0 < summary["wait_share"] <= 1.0


@pytest.mark.slow
def test_resident_run_writes_zero_waits_and_tensorboard_scalars(corpus, tmp_path):
    run_dir = tmp_path / "run"
    train, summary = _run(corpus, run_dir, **{"train.tensorboard": "true"})
    assert [r["wait_s"] for r in train] == [0.0] * STEPS
    assert summary["wait_s"] == 0.0 and summary["wait_share"] == 0.0
    acc = _accumulator(run_dir / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/aux_loss", "train/lr", "train/tokens_per_s", "train/grad_norm",
            "train/imbalance", "train/wait_s", "val/loss"}
    assert want <= tags, want - tags
    for tag in want - {"val/loss"}:
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    assert [e.step for e in acc.Scalars("val/loss")] == [3, 6]
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses == pytest.approx([r["loss"] for r in train], rel=1e-6)
    # resumed at step 3: the events the first run wrote past it are purged, not doubled
    resumed = resume_copy(run_dir, tmp_path / "resumed", 3)
    config = tiny_run_config(corpus, resumed, steps=STEPS, every=3, keep_last=1,
                             **{"train.tensorboard": "true"})
    assert Trainer(config, resumed, resume=True, out=open("/dev/null", "w")).run() == 0
    acc = _accumulator(resumed / "tensorboard")
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-5)


def test_scalar_log_writes_what_the_records_hold(tmp_path):
    log = ScalarLog(tmp_path / "tb")
    log.write({"kind": "train", "step": 1, "loss": 5.0, "aux_loss": 0.02, "lr": 1e-3,
               "tokens_per_s": 900.0, "grad_norm": None, "imbalance": 1.5, "wait_s": 0.25,
               "device_load_max_over_mean": 1.2, "tokens_per_expert": [[1, 2]]})
    log.write({"kind": "val", "step": 1, "val_loss": 4.5})
    log.write({"kind": "summary", "step": 1, "train_loss": 5.0})
    log.close()
    acc = _accumulator(tmp_path / "tb")
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert set(got) == set(TRAIN_TAGS.values()) - {"train/grad_norm"} | {"val/loss"}
    assert got["train/wait_s"] == [(1, 0.25)] and got["val/loss"] == [(1, 4.5)]


@pytest.mark.slow
def test_tensorboard_without_the_package_is_refused_naming_the_install(tmp_path):
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'tensorboard': raise ImportError(name)\n"
               "sys.meta_path.insert(0, Block())\n")    # as if it were not installed
    code = ("from moescale.train.metrics import MetricsLog\n"
            f"MetricsLog({str(tmp_path / 'm.jsonl')!r}, tensorboard=True)\n")
    proc = subprocess.run([sys.executable, "-c", blocker + code], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "pip install tensorboard" in proc.stderr
    assert "train.tensorboard" in proc.stderr


def test_report_series_skip_missing_and_non_finite_values():
    train = [{"grad_norm": 1.0}, {"grad_norm": None}, {"grad_norm": math.nan}, {},
             {"grad_norm": 2.0}]
    assert _series(train, "grad_norm", [1, 2, 3, 4, 5]) == ([1, 5], [1.0, 2.0])


@pytest.mark.slow
def test_report_draws_the_signal_panels(tmp_path):
    records = [{"kind": "train", "step": s, "loss": 5.0 - 0.1 * s, "aux_loss": 0.02,
                "lr": 1e-3, "grad_norm": None if s == 2 else 1.0 + s, "tokens": 512,
                "tokens_per_s": 1000.0, "wait_s": 0.1, "imbalance": 1.3,
                "device_load_max_over_mean": 1.1, "tokens_per_expert": [[3, 1], [2, 2]]}
               for s in range(1, 6)] + [{"kind": "val", "step": 5, "val_loss": 4.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = write_report(tmp_path)
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (1170, 1350)   # 13 x 15 in at 90 dpi: the 3 x 2 grid + heatmap


@pytest.mark.slow
def test_report_axes_log_loss_with_lr_labelled_experts_and_no_empty_wait_box(tmp_path,
                                                                               monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    records = [{"kind": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3 * s, "tokens": 512,
                "tokens_per_s": 1000.0, "wait_s": 0.0, "tokens_per_expert": [[3, 1], [2, 2]]}
               for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(tmp_path)
    (fig,) = figures
    loss_ax = fig.axes[0]
    assert loss_ax.get_yscale() == "log"
    lr_ax = next(a for a in fig.axes if a.get_ylabel() == "learning rate")
    assert list(lr_ax.lines[0].get_ydata()) == [1e-3 * s for s in range(1, 6)]
    wait_ax = next(a for a in fig.axes if a.get_title().startswith("expert wait"))
    assert not wait_ax.axison
    heat = next(a for a in fig.axes if a.get_title().startswith("tokens per expert"))
    assert [t.get_text() for t in heat.get_yticklabels(minor=True)] == ["e0", "e1", "e0", "e1"]
    plt.close(fig)
