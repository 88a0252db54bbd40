"""`moescale train --parallel.placement dynamic` on 2 gloo ranks (real processes).

The experts live in one host copy in /dev/shm shared by both ranks; every MoE call places them
by LPT (+ hot-expert splitting). The single-process equivalent is plain device-only training of
the same config (torch's AdamW, global-norm clipping): every rank takes its slice of the same
global batch. Checked here: two micro-batches per step (experts resident, and on the disk tier)
match the single-process run and the logged load covers both calls of every layer;
`torchrun --nproc-per-node 2 -m moescale train` runs it (rank 0 prints the summary's load line;
the ranks forked with torchrun's worker variables: tests/warm_runner.py); bad launches are
ValueErrors. Twenty steps equal to single-process training, the per-step load fields, the
consolidated checkpoint, /dev/shm left clean and resuming across layouts are
tests/train/test_setup_matrix.py's (dynamic row); bad option combinations:
test_config_and_data.py; several nodes: test_train_nodes.py."""

from __future__ import annotations

import json
import os

import pytest

from moescale.train.exchange import check_launch
from moescale.train.launch import train_distributed
from moescale.train.config import load_config
from moescale.train.trainer import Trainer
from train_helpers import TINY, as_argv, assert_same_run, run_records
from warm_runner import run_warm_torchrun

pytestmark = pytest.mark.distributed

DYNAMIC = {"parallel.placement": "dynamic"}
CPU = {"train.device": "cpu"}     # the reference runs where the dynamic ranks compute


ACCUM = dict(TINY, **CPU, **{"train.steps": "6", "train.eval_interval": "0",
                            "train.checkpoint_interval": "0", "train.grad_accum": "2"})
RESIDENCIES = {"resident": {}, "disk": {"offload.mode": "disk", "offload.host_cache": "192KiB"}}


@pytest.fixture(scope="module")
def accum_single(corpus, tmp_path_factory):
    """Single-process resident training with two micro-batches per step: what both
    residencies of test_gradient_accumulation must log."""
    single = tmp_path_factory.mktemp("accum") / "single"
    config = load_config(None, dict(ACCUM, **{"data.path": str(corpus),
                                              "train.run_dir": str(single)}))
    assert Trainer(config, single, out=open(os.devnull, "w")).run() == 0
    return run_records(single)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("residency", RESIDENCIES)
def test_gradient_accumulation(corpus, accum_single, tmp_path, residency):
    """Two micro-batches per step: both passes accumulate into the store (possibly through
    different owners; on the disk tier through the files, a fence between the passes) and the
    logged load covers both calls of every layer."""
    dynamic = tmp_path / "dyn"
    config = load_config(None, dict(ACCUM, **DYNAMIC, **RESIDENCIES[residency], **{
        "data.path": str(corpus), "train.run_dir": str(dynamic)}))
    code, summary = train_distributed(config, dynamic, 2, quiet=True, deadline_s=150)
    assert code == 0 and summary["step"] == 6
    assert_same_run(run_records(dynamic), accum_single)
    for r in run_records(dynamic):
        if r["kind"] == "train":
            assert r["device_load_mean"] == sum(map(sum, r["tokens_per_expert"])) / 2


@pytest.mark.timeout(120)
def test_torchrun_cli(corpus, tmp_path):
    options = dict(TINY, **{"train.steps": "4", "train.eval_interval": "0"})
    argv = ["train", *as_argv(options), "--data.path", str(corpus), "--parallel.placement",
            "dynamic", "--train.run_dir", str(tmp_path / "run")]
    code, output = run_warm_torchrun(2, argv, tmp_path, dict(os.environ), 100)
    assert code == 0, output[-6000:]
    assert output.count("device load:  max/mean") == 1      # rank 0 prints it
    assert "shared by the 2 local ranks" in output
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
