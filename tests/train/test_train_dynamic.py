"""`moescale train --parallel.placement dynamic` on 2 gloo ranks (real processes).

The experts live in one host copy in /dev/shm shared by both ranks; every MoE call places them
by LPT (+ hot-expert splitting). The single-process equivalent is plain device-only training of
the same config (torch's AdamW, global-norm clipping): every rank takes its slice of the same
global batch. Checked: 20 steps through `train_distributed` give the single-process losses,
validation losses, grad norms and routed counts (fp32 tolerance); every logged step holds the
modelled max/mean device load (dynamic and static placement, >= 1) and the summary their means;
the checkpoint is consolidated (the single-process keys, shapes and optimizer groups);
checkpoints resume across layouts (single process -> 2 dynamic ranks -> single process) with
the uninterrupted losses; two micro-batches per step match too; the torchrun CLI runs it; no
store file is left in /dev/shm; bad launches are ValueErrors (bad option combinations:
test_config_and_data.py; several nodes: test_train_nodes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moescale.train.exchange import check_launch
from moescale.train.launch import train_distributed
from moescale.train.checkpoint import checkpoint_path, load_checkpoint
from moescale.train.config import load_config
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import TINY, as_argv, small_corpus
from test_train_parallel import OPTIONS, STEPS, _assert_same_run, _records, continue_run

pytestmark = pytest.mark.distributed

DYNAMIC = {"parallel.placement": "dynamic"}
CPU = {"train.device": "cpu"}     # the reference runs where the dynamic ranks compute


def _store_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("moescale-store-")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn")
    corpus = small_corpus(root / "corpus")
    options = dict(OPTIONS, **CPU, **{"data.path": str(corpus)})
    single = root / "single"
    config = load_config(None, dict(options, **{"train.run_dir": str(single)}))
    assert Trainer(config, single, out=open(os.devnull, "w")).run() == 0
    before = _store_files()
    dynamic = root / "dyn2"
    config = load_config(None, dict(options, **DYNAMIC, **{"train.run_dir": str(dynamic)}))
    code, summary = train_distributed(config, dynamic, 2, quiet=True, deadline_s=100)
    assert code == 0
    assert _store_files() == before        # the store's name is gone once every rank mapped it
    return corpus, single, dynamic, summary


@pytest.mark.timeout(150)
def test_two_rank_dynamic_run_equals_single_process(runs):
    _, single, dynamic, summary = runs
    _assert_same_run(_records(dynamic), _records(single))
    assert summary["world_size"] == 2 and summary["placement"] == "dynamic"
    one_tensors, one_state = load_checkpoint(checkpoint_path(single / "checkpoints", STEPS))
    dyn_tensors, dyn_state = load_checkpoint(checkpoint_path(dynamic / "checkpoints", STEPS))
    assert dyn_tensors.keys() == one_tensors.keys()
    assert dyn_state["optimizer"] == one_state["optimizer"]
    for key, value in one_tensors.items():
        if key.startswith(("model.", "optim.")) and value.is_floating_point():
            assert dyn_tensors[key].shape == value.shape, key
            torch.testing.assert_close(dyn_tensors[key], value, rtol=1e-3, atol=1e-5, msg=key)


def test_every_step_logs_the_modelled_device_load(runs):
    _, single, dynamic, summary = runs
    train = [r for r in read_metrics(dynamic / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == STEPS
    for r in train:
        assert r["device_load_max"] >= r["device_load_mean"] > 0
        assert r["device_load_max_over_mean"] >= 1.0 and r["static_load_max_over_mean"] >= 1.0
        assert r["device_load_worst_layer"] >= r["device_load_max_over_mean"] - 1e-12
        # rows: every routed token-expert pair of the step's 2 MoE layers, over 2 devices
        assert r["device_load_mean"] == sum(map(sum, r["tokens_per_expert"])) / 2
    mean = sum(r["device_load_max_over_mean"] for r in train) / STEPS
    assert summary["mean_device_load_max_over_mean"] == pytest.approx(mean)
    assert "mean_static_load_max_over_mean" in summary
    single_train = [r for r in read_metrics(single / "metrics.jsonl") if r["kind"] == "train"]
    assert "device_load_max_over_mean" not in single_train[0]      # one device: nothing


@pytest.mark.timeout(150)
def test_resume_across_layouts(runs, tmp_path):
    _, single, dynamic, _ = runs
    want = _records(single)
    # a single-process checkpoint continued on 2 dynamic-placement ranks, and back
    got = continue_run(single, tmp_path / "to_dyn", DYNAMIC, 2)
    _assert_same_run(got, want, first_step=STEPS // 2)
    got = continue_run(dynamic, tmp_path / "to_one", {"parallel.placement": "static"}, 1)
    _assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.timeout(120)
def test_gradient_accumulation(runs, tmp_path):
    """Two micro-batches per step: both passes accumulate into the store (possibly through
    different owners) and the logged load covers both calls of every layer."""
    corpus = runs[0]
    options = dict(TINY, **CPU, **{"train.steps": "6", "train.eval_interval": "0",
                            "train.grad_accum": "2", "data.path": str(corpus)})
    single = tmp_path / "single"
    config = load_config(None, dict(options, **{"train.run_dir": str(single)}))
    assert Trainer(config, single, out=open(os.devnull, "w")).run() == 0
    dynamic = tmp_path / "dyn"
    config = load_config(None, dict(options, **DYNAMIC, **{"train.run_dir": str(dynamic)}))
    assert train_distributed(config, dynamic, 2, quiet=True, deadline_s=100)[0] == 0
    _assert_same_run(_records(dynamic), _records(single))
    for r in _records(dynamic):
        if r["kind"] == "train":
            assert r["device_load_mean"] == sum(map(sum, r["tokens_per_expert"])) / 2


@pytest.mark.timeout(120)
def test_torchrun_cli(runs, tmp_path):
    corpus = runs[0]
    options = dict(TINY, **{"train.steps": "4", "train.eval_interval": "0"})
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "moescale", "train", *as_argv(options), "--data.path", str(corpus),
                           "--parallel.placement", "dynamic", "--train.run_dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("device load:  max/mean") == 1      # rank 0 prints it
    assert "shared by the 2 local ranks" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mean_device_load_max_over_mean"] >= 1.0


def test_a_dynamic_run_needs_a_launch(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = load_config(None, DYNAMIC)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node N"):
        check_launch(config)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")     # 2 x 2 would be nodes (test_train_nodes.py)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the 4 ranks"):
        check_launch(config)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config = load_config(None, dict(DYNAMIC, **{"train.batch_size": "6"}))
    with pytest.raises(ValueError, match="train.batch_size=6"):
        check_launch(config)
