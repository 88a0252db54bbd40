"""`moescale train` with expert parallelism AND offloaded experts on 2 gloo ranks (real
processes), through `torchrun --nproc-per-node 2 -m moescale train` (its ranks forked with
torchrun's worker variables: tests/warm_runner.py) and train_distributed (its Python twin).

Each rank owns 2 of the 4 experts of every MoE layer, in its own ExpertStore (files under
expert-store/rank<r> for the disk tier), streamed through a 2-expert device budget and stepped
by its host AdamW. Checked against single-process device-only training with torch AdamW: under
torchrun (the disk tier, deferred steps with global-norm clipping), 20 steps give the same
losses, validation losses, grad norms and routed counts (fp32, relative 1e-5) and the modelled
per-rank load every step; only rank 0 prints the summary; every rank's device peak stays within
the budget; each rank wrote its own experts' files; the checkpoint's dense half is the
single-process one. Pin mode with eager steps, gradient accumulation 2 and no clipping trains
the same losses within the budget too. More ranks than ep_size with offloading is refused. The
host and disk tiers on every exchange through train_distributed, the shards' layout and resuming
at other rank counts are tests/train/test_setup_matrix.py's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moescale.train.launch import train_distributed
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import TINY, checkpoint_tensors, tiny_run_config, torchrun_train

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


def _assert_within_budget(summary):
    memory = summary["memory"]
    assert memory["device_budget_bytes"] > 0
    assert len(memory["device_peak_bytes_per_rank"]) == 2
    for peak in memory["device_peak_bytes_per_rank"]:     # every rank streamed experts
        assert 0 < peak <= memory["device_budget_bytes"]


@pytest.mark.timeout(120)
def test_disk_offloaded_shards_train_like_one_process_under_torchrun(corpus, single, tmp_path):
    run_dir = tmp_path / "ep_disk"
    options = dict(TINY, **EP_OFFLOAD, **{
        "offload.mode": "disk", "data.path": str(corpus), "train.steps": str(STEPS),
        "train.eval_interval": "10", "train.checkpoint_interval": "10", "train.keep_last": "2",
        "train.run_dir": str(run_dir)})
    output = torchrun_train(options, tmp_path, 100)
    assert output.count("run dir:") == 1          # only rank 0 prints the summary
    assert output.count("device load:  max/mean") == 1
    assert "split over 2 expert-parallel ranks" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["offload_plan"] == "disk"
    _assert_same(_records(run_dir), _records(single))
    for r in _records(run_dir):      # static placement's modelled per-rank load, every step
        assert r["kind"] == "val" or r["device_load_max_over_mean"] >= 1.0
    _assert_within_budget(summary)
    memory = summary["memory"]
    assert memory["disk_bytes"] > 0 and memory["disk_read_bytes"] > 0
    for rank in (0, 1):                            # each rank its own directory of experts
        files = list((run_dir / "expert-store" / f"rank{rank}").rglob("expert*.bin"))
        assert len(files) == 2 * 2, files          # 2 MoE layers x 2 local experts
    # the checkpoint's dense half (experts left out) is the single-process one
    ep_tensors, ep_state = checkpoint_tensors(run_dir, STEPS)
    one_tensors, _ = checkpoint_tensors(single, STEPS)
    assert ep_tensors.keys() == one_tensors.keys() and ep_state["step"] == STEPS
    assert not any("experts." in k for k in ep_tensors)
    for key in one_tensors:
        if key.startswith("model."):
            torch.testing.assert_close(ep_tensors[key], one_tensors[key], rtol=1e-3, atol=1e-5,
                                       msg=key)


@pytest.mark.timeout(120)
def test_eager_steps_with_accumulation_without_clipping(corpus, tmp_path):
    options = {"train.steps": "4", "optim.grad_clip": "0", "train.checkpoint_interval": "0",
               "train.eval_interval": "0", "train.grad_accum": "2"}
    one = tmp_path / "one"
    assert Trainer(_config(corpus, one, **options), one, out=open(os.devnull, "w")).run() == 0
    run_dir = tmp_path / "eager"
    summary = _distributed(_config(corpus, run_dir, **EP_OFFLOAD, **options, **{
        "offload.mode": "pin", "offload.step_mode": "eager"}), run_dir)
    _assert_within_budget(summary)
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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compact_state_on_two_ranks_trains_like_one_process(corpus, tmp_path):
    """bf16 masters and int8 moments in each rank's own store: the stochastic rounding is
    keyed by the global expert, so 2 expert-parallel ranks train like one process with the
    same format (reduction order aside)."""
    options = {"train.steps": "8", "train.checkpoint_interval": "0", "train.eval_interval": "0",
               "offload.mode": "host", "offload.master": "bf16", "offload.moments": "int8"}
    one = tmp_path / "one"
    assert Trainer(_config(corpus, one, **options, **{"offload.device_budget_experts": "2"}),
                   one, out=open(os.devnull, "w")).run() == 0
    run_dir = tmp_path / "two"
    _distributed(_config(corpus, run_dir, **EP_OFFLOAD, **options), run_dir)
    _assert_same(_records(run_dir), _records(one), rel=1e-4)
