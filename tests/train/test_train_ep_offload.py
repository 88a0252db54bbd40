"""`moescale train` with expert parallelism AND offloaded experts on 2 gloo ranks (real
processes via train_distributed, the Python twin of torchrun).

Runs through train_distributed and (disk) through `torchrun ... -m moescale train`.
Each rank owns 2 of the 4 experts of every MoE layer, in its own ExpertStore (host RAM, or
files under expert-store/rank<r>), streamed through a 2-expert device budget and stepped by its
host AdamW. Checked against single-process device-only training with torch AdamW: 20 steps
(host, deferred with global-norm clipping; disk likewise) give the same losses, validation
losses, grad norms and routed counts (fp32, relative 1e-5); pin mode with eager steps, gradient
accumulation 2 and no clipping too.
Every rank's simulated device peak stays within the budget. The checkpoint's dense half is the
single-process one and each rank wrote its own experts' shard (resuming at other rank counts is
tests/train/test_setup_matrix.py's). More ranks than ep_size with offloading is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moescale.train.launch import train_distributed
from moescale.train.checkpoint import checkpoint_path, load_checkpoint
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import TINY, as_argv, tiny_run_config

pytestmark = pytest.mark.distributed

STEPS = 20
EP_OFFLOAD = {"parallel.ep_size": "2", "offload.device_budget_experts": "2"}


def _config(corpus, run_dir, **extra):
    return tiny_run_config(corpus, run_dir, steps=STEPS, every=10, keep_last=2, **extra)


def _records(run_dir, after=0):
    return [r for r in read_metrics(run_dir / "metrics.jsonl")
            if r["kind"] in ("train", "val") and r["step"] > after]


def _assert_same(got, want, rel=1e-5, keys=("loss", "val_loss", "aux_loss", "grad_norm")):
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for a, b in zip(got, want):
        for key in keys:
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-7), (key, a["step"])
        assert a.get("tokens_per_expert") == b.get("tokens_per_expert"), a["step"]


def _distributed(config, run_dir, **kw):
    code, summary = train_distributed(config, run_dir, 2, quiet=True, deadline_s=100, **kw)
    assert code == 0
    return summary


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    assert Trainer(_config(corpus, run_dir), run_dir, out=open(os.devnull, "w")).run() == 0
    return run_dir


@pytest.fixture(scope="module")
def host_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ep_host") / "run"
    summary = _distributed(_config(corpus, run_dir, **EP_OFFLOAD, **{"offload.mode": "host"}),
                           run_dir)
    return run_dir, summary


def _assert_within_budget(summary):
    memory = summary["memory"]
    assert memory["device_budget_bytes"] > 0
    assert len(memory["device_peak_bytes_per_rank"]) == 2
    for peak in memory["device_peak_bytes_per_rank"]:     # every rank streamed experts
        assert 0 < peak <= memory["device_budget_bytes"]


@pytest.mark.timeout(120)
def test_host_offloaded_shards_train_like_one_process(host_run, single):
    run_dir, summary = host_run
    _assert_same(_records(run_dir), _records(single))
    _assert_within_budget(summary)
    assert summary["world_size"] == 2 and summary["offload_plan"] == "host"
    # the dense half equals the single-process one; each rank wrote its own experts' shard
    ep_tensors, ep_state = load_checkpoint(checkpoint_path(run_dir / "checkpoints", STEPS))
    one_tensors, one_state = load_checkpoint(checkpoint_path(single / "checkpoints", STEPS))
    assert ep_tensors.keys() == one_tensors.keys()
    assert not any("experts." in k for k in ep_tensors)
    for key in one_tensors:
        if key.startswith("model."):
            torch.testing.assert_close(ep_tensors[key], one_tensors[key], rtol=1e-3, atol=1e-5,
                                       msg=key)
    shards = ep_state["expert_shards"]
    assert sorted(s["rank"] for s in shards) == [0, 1]
    for layer in shards[0]["experts"]:     # disjoint halves of every layer's 4 experts
        held = sorted(tuple(r) for s in shards for r in s["experts"][layer])
        assert held == [(0, 2), (2, 4)], (layer, held)


@pytest.mark.timeout(120)
def test_disk_offloaded_shards_train_like_one_process_under_torchrun(corpus, single, tmp_path):
    run_dir = tmp_path / "ep_disk"
    options = dict(TINY, **EP_OFFLOAD, **{
        "offload.mode": "disk", "data.path": str(corpus), "train.steps": str(STEPS),
        "train.eval_interval": "10", "train.checkpoint_interval": "10", "train.keep_last": "2",
        "train.run_dir": str(run_dir)})
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m",
                           "moescale", "train", *as_argv(options)], capture_output=True,
                          text=True, timeout=100, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("run dir:") == 1 and "2 expert-parallel ranks" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    _assert_same(_records(run_dir), _records(single))
    _assert_within_budget(summary)
    memory = summary["memory"]
    assert memory["disk_bytes"] > 0 and memory["disk_read_bytes"] > 0
    for rank in (0, 1):                            # each rank its own directory of experts
        files = list((run_dir / "expert-store" / f"rank{rank}").rglob("expert*.bin"))
        assert len(files) == 2 * 2, files          # 2 MoE layers x 2 local experts


@pytest.mark.timeout(120)
def test_eager_steps_with_accumulation_without_clipping(corpus, tmp_path):
    options = {"train.steps": "4", "optim.grad_clip": "0", "train.checkpoint_interval": "0",
               "train.eval_interval": "0", "train.grad_accum": "2"}
    one = tmp_path / "one"
    assert Trainer(_config(corpus, one, **options), one, out=open(os.devnull, "w")).run() == 0
    run_dir = tmp_path / "eager"
    _distributed(_config(corpus, run_dir, **EP_OFFLOAD, **options, **{
        "offload.mode": "pin", "offload.step_mode": "eager"}), run_dir)
    got = _records(run_dir)
    assert [r["grad_norm"] for r in got if r["kind"] == "train"] == [None] * 4
    _assert_same(got, _records(one), keys=("loss", "val_loss", "aux_loss"))


@pytest.mark.timeout(60)
def test_replicated_offloaded_shards_are_refused(corpus, tmp_path):
    run_dir = tmp_path / "replicas"
    config = _config(corpus, run_dir, **{"offload.mode": "host", "train.steps": "1"})
    with pytest.raises(RuntimeError, match="not replicated over data-parallel ranks; set "
                                           "parallel.ep_size 2"):
        train_distributed(config, run_dir, 2, quiet=True, deadline_s=50)
