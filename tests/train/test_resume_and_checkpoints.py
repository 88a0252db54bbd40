"""Checkpoints and exact resume, in process: a run stopped halfway and resumed logs exactly the
losses of an uninterrupted run; a truncated or corrupted checkpoint is refused with a clear
error, set aside (never deleted) and the previous one is used."""

from __future__ import annotations

import shutil

import pytest
import torch

from moescale.train.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint,
                                       load_latest, save_checkpoint)
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import small_corpus, tiny_run_config

STEPS = 8
COMPARED = ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_expert", "val_loss")


def _config(corpus, run_dir, **extra):
    return tiny_run_config(corpus, run_dir, steps=STEPS, every=4, keep_last=5, **extra)


def _losses(run_dir):
    return [{k: r[k] for k in COMPARED if k in r} | {"kind": r["kind"], "step": r["step"]}
            for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("train", "val")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    corpus = small_corpus(root / "corpus")
    run_dir = root / "run"
    assert Trainer(_config(corpus, run_dir), run_dir, out=open("/dev/null", "w")).run() == 0
    return corpus, run_dir


def test_resume_equals_uninterrupted(straight, tmp_path):
    corpus, reference = straight
    run_dir = tmp_path / "run"
    first = Trainer(_config(corpus, run_dir), run_dir, out=open("/dev/null", "w"))
    assert first.run(until_step=STEPS // 2) == 0
    # the initial state (step 0) stays until a later checkpoint is trusted (trust.py)
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [0, STEPS // 2]
    del first
    second = Trainer(_config(corpus, run_dir), run_dir, resume=True, out=open("/dev/null", "w"))
    assert second.step == STEPS // 2
    assert second.run() == 0
    expected, got = _losses(reference), _losses(run_dir)
    assert len(got) == STEPS + STEPS // 4
    assert got == expected          # bitwise: same floats, same routed token counts


def test_truncated_and_corrupted_checkpoints_are_refused(straight, tmp_path):
    corpus, reference = straight
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    ckpts = dict(list_checkpoints(run_dir / "checkpoints"))
    assert sorted(ckpts) == [4, 8]      # the initial state went at the normal end (trust.py)
    last = ckpts[8]
    size = last.stat().st_size
    with open(last, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(last)
    warnings = []
    path, _, state = load_latest(run_dir / "checkpoints", warn=warnings.append)
    assert path == ckpts[4] and state["step"] == 4
    assert len(warnings) == 1 and "ckpt_00000008" in warnings[0]

    resumed = Trainer(_config(corpus, run_dir), run_dir, resume=True,
                      out=open("/dev/null", "w"), err=open("/dev/null", "w"))
    assert resumed.step == 4
    assert ckpts[4].exists()                                    # the previous one is kept
    assert last.with_name(last.name + ".corrupt").exists()      # the bad one is set aside
    assert resumed.run() == 0
    assert _losses(run_dir) == _losses(reference)


def test_checksum_catches_a_flipped_byte(tmp_path):
    tensors = {"w": torch.randn(64, 64), "step": torch.tensor(3.0)}
    path = save_checkpoint(tmp_path, 1, tensors, {"step": 1}, keep_last=3)
    loaded, state = load_checkpoint(path)
    assert state == {"step": 1} and loaded["w"].equal(tensors["w"])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40                                  # inside the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest(tmp_path, warn=lambda m: None)


def test_keep_last_and_no_temp_files(tmp_path):
    shared = torch.randn(8, 8)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"a": shared, "tied": shared}, {"step": step},
                        keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000004.safetensors",
                                                          "ckpt_00000005.safetensors"]
    loaded, _ = load_checkpoint(tmp_path / "ckpt_00000005.safetensors")
    assert loaded["a"].equal(shared) and loaded["tied"].equal(shared)


def test_resume_is_exact_with_router_noise_grad_accum_and_bf16(straight, tmp_path):
    corpus, _ = straight
    extra = {"model.router": "noisy_topk", "train.grad_accum": "2", "train.precision": "bf16",
             "train.steps": "4", "train.checkpoint_interval": "0", "train.eval_interval": "2"}
    runs = {}
    for name in ("straight", "resumed"):
        run_dir = tmp_path / name
        trainer = Trainer(_config(corpus, run_dir, **extra), run_dir, out=open("/dev/null", "w"))
        if name == "resumed":
            assert trainer.run(until_step=2) == 0
            trainer = Trainer(_config(corpus, run_dir, **extra), run_dir, resume=True,
                              out=open("/dev/null", "w"), err=open("/dev/null", "w"))
        assert trainer.run() == 0
        runs[name] = _losses(run_dir)
    assert len(runs["straight"]) == 4 + 2
    assert runs["resumed"] == runs["straight"]
