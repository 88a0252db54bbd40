"""`moescale train` with expert parallelism on 2 gloo ranks (real processes).

The single-process equivalent of a W-rank run is the same config on one process: every rank
draws the same global batch and trains on its slice of the rows, so the global batch is the
union of the ranks' batches and the loss (mean over all tokens of all ranks) is the
single-process loss. Checked: through the CLI under torchrun, 20 AdamW steps give the
single-process losses, validation losses, grad norms (fp32 tolerance) and routed token counts;
only rank 0 prints and writes; the checkpoint's dense half has the single-process keys and
values. `continue_run` resumes a run's mid-run checkpoint on N ranks (used by the dynamic and
node tests; resuming across rank counts for every set-up is test_setup_matrix.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from moescale.cli import main as moescale_main
from moescale.train.launch import train_distributed
from moescale.train.checkpoint import checkpoint_path, load_checkpoint
from moescale.train.config import load_config
from moescale.train.trainer import Trainer
from train_helpers import (TINY, as_argv, assert_same_run, resume_copy, run_records,
                           small_corpus)

STEPS = 20
OPTIONS = dict(TINY, **{"train.steps": str(STEPS), "train.eval_interval": "10",
                        "train.checkpoint_interval": "10", "train.keep_last": "2"})


def _records(run_dir):
    return run_records(run_dir)


_assert_same_run = assert_same_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    corpus = small_corpus(root / "corpus")
    args = ["train", *as_argv(OPTIONS), "--data.path", str(corpus)]
    single = root / "single"
    assert moescale_main([*args, "--train.run_dir", str(single)]) == 0
    ep = root / "ep2"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "moescale", *args, "--parallel.ep_size", "2",
                           "--train.run_dir", str(ep)],
                          capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return corpus, single, ep, proc


@pytest.mark.timeout(150)
def test_two_rank_cli_run_equals_single_process(runs):
    corpus, single, ep, proc = runs
    _assert_same_run(_records(ep), _records(single))
    for r in _records(ep):      # static placement's modelled per-rank load, every step
        assert r["kind"] == "val" or r["device_load_max_over_mean"] >= 1.0
    assert proc.stdout.count("run dir:") == 1          # only rank 0 prints the summary
    assert proc.stdout.count("device load:  max/mean") == 1
    summary = json.loads((ep / "summary.json").read_text())
    assert summary["world_size"] == 2 and "expert-parallel" not in summary["offload_plan"]
    assert "split over 2 expert-parallel ranks" in proc.stdout
    # the checkpoint is consolidated: the single-process keys and shapes, close values
    ep_tensors, ep_state = load_checkpoint(checkpoint_path(ep / "checkpoints", STEPS))
    one_tensors, _ = load_checkpoint(checkpoint_path(single / "checkpoints", STEPS))
    assert ep_tensors.keys() == one_tensors.keys()
    for key, value in one_tensors.items():
        if key.startswith(("model.", "optim.")) and value.is_floating_point():
            assert ep_tensors[key].shape == value.shape, key
            torch.testing.assert_close(ep_tensors[key], value, rtol=1e-3, atol=1e-5,
                                       msg=key)
    assert ep_state["step"] == STEPS


def _continued(run_dir):
    return [r for r in _records(run_dir) if r["step"] > STEPS // 2]


def _resume_copy(src: Path, dst: Path, step: int) -> Path:
    return resume_copy(src, dst, step)


def continue_run(src: Path, dst: Path, overrides: dict[str, str], ranks: int) -> list[dict]:
    """Resume a copy of run `src` from its mid-run checkpoint with `overrides` on `ranks`
    processes (the Python API) to the end; the records it logged after the checkpoint."""
    run_dir = _resume_copy(src, dst, STEPS // 2)
    base = tomllib.loads((run_dir / "config.toml").read_text())
    config = load_config(None, dict(overrides, **{"train.run_dir": str(run_dir)}), base=base)
    if ranks > 1:
        code, summary = train_distributed(config, run_dir, ranks, resume=True, quiet=True,
                                          deadline_s=100)
        assert code == 0 and summary["world_size"] == ranks and summary["step"] == STEPS
    else:
        trainer = Trainer(config, run_dir, resume=True, out=open(os.devnull, "w"))
        assert trainer.step == STEPS // 2 and trainer.run() == 0
    return _continued(run_dir)
