"""`parallel.dense replicate` on several ranks: the dense gradients averaged by DDP in training.

Real gloo processes on 127.0.0.1 (`torchrun --nproc-per-node 2 -m moescale train`, its ranks
forked by tests/warm_runner.py; the resumed run through train_distributed). The exchange wraps the model in DDP for
the training step's forward and backward (parallel/dense_ddp.py; its experts ignored), and the
summary's plan says so. With gradient accumulation over 2 micro-batches (DDP reduces on the
last one only) and a live global-norm clip, 2 expert-parallel ranks train the single-process
run's losses, validation losses, balance losses and grad norms (train_helpers.assert_same_run:
1e-5 and 1e-4 relative) and routed counts. The checkpoint holds the single process's keys (no
`module.` prefix) and its dense weights; resumed on 2 ranks from the middle it logs the
uninterrupted run's numbers. The hand-written all-reduce against DDP step by step:
tests/parallel/test_dense_ddp.py; DDP beside expert replicas averaged over their dp column
(4 ranks as 2 EP groups x 2): test_train_sharded.py's replicated run of that layout.
"""

from __future__ import annotations

import json

import pytest
import torch

from train_helpers import (TINY, assert_same_run, checkpoint_tensors, continue_run, run_records,
                           tiny_run_config, torchrun_train, train_run)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 6
OPTIONS = {"train.grad_accum": "2", "optim.grad_clip": "1.0"}


def _config(corpus, run_dir, **extra):
    return tiny_run_config(corpus, run_dir, steps=STEPS, every=3, keep_last=2,
                           **OPTIONS, **extra)


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train_run(_config(corpus, run_dir), run_dir, 1, STEPS)
    return run_dir


@pytest.mark.timeout(240)
def test_ddp_replicated_training_equals_one_process_and_resumes(corpus, single, tmp_path):
    run_dir = tmp_path / "ddp"
    options = dict(TINY, **OPTIONS, **{
        "parallel.ep_size": "2", "data.path": str(corpus), "train.steps": str(STEPS),
        "train.eval_interval": "3", "train.checkpoint_interval": "3", "train.keep_last": "2",
        "train.run_dir": str(run_dir)})
    output = torchrun_train(options, tmp_path, 150)
    assert "dense half replicated, averaged by DDP during backward" in output
    got = run_records(run_dir)
    assert_same_run(got, run_records(single))
    assert all(r["grad_norm"] > 1.0 for r in got if r["kind"] == "train")   # clip live
    # the checkpoint: the single process's keys (the inner module's) and dense weights
    tensors, state = checkpoint_tensors(run_dir, STEPS)
    want, _ = checkpoint_tensors(single, STEPS)
    assert tensors.keys() == want.keys() and not any("module." in k for k in tensors)
    assert state["step"] == STEPS
    for key, value in want.items():
        if key.startswith("model.") and "experts." not in key:
            torch.testing.assert_close(tensors[key], value, rtol=1e-4, atol=1e-6, msg=key)
    # resumed on 2 ranks from step 3: DDP built again around the loaded weights
    resumed = continue_run(run_dir, tmp_path / "resumed", {}, 2, 3)
    assert_same_run(resumed, [r for r in got if r["step"] > 3])
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["step"] == STEPS
