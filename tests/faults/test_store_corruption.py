"""A corrupt expert shard in a disk-tier run's newest checkpoint: `--resume` names the
corruption, falls back to the previous checkpoint whose dense half and expert shards both
verify, and then logs exactly the uninterrupted run's numbers; a shard whose index is not the
one its checkpoint names (edited after the commit) or that is missing is refused the same
way."""

from __future__ import annotations

import io
import os
import shutil

import pytest

from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import tiny_run_config

STEPS = 6
DISK = {"offload.mode": "disk", "offload.host_cache": "192KiB"}


def _records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("train", "val")]


def _run(corpus, run_dir, resume=False, until=None):
    err = io.StringIO()
    trainer = Trainer(tiny_run_config(corpus, run_dir, steps=STEPS, every=2, keep_last=2, **DISK),
                      run_dir, resume=resume, out=open(os.devnull, "w"), err=err)
    assert trainer.run(until_step=until) == 0
    return trainer, err.getvalue()


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _run(corpus, run_dir)
    return _records(run_dir)


def _flip_bit(shards_dir):
    path = next(shards_dir.glob("rank*/layer001/expert00002.bin"))
    data = bytearray(path.read_bytes())
    data[403] ^= 0x40            # one exponent bit of one master weight
    path.write_bytes(bytes(data))


def _index_edited(shards_dir):
    path = next(shards_dir.glob("rank*/index.json"))
    path.write_text(path.read_text().replace('"format"', '"format" '))


def _shard_missing(shards_dir):
    shutil.rmtree(next(shards_dir.glob("rank*")))


@pytest.mark.parametrize("damage", [_flip_bit, _index_edited, _shard_missing])
def test_a_corrupt_store_falls_back_to_the_previous_checkpoint(corpus, straight, tmp_path,
                                                              damage):
    run_dir = tmp_path / "run"
    _run(corpus, run_dir)                           # checkpoints 4 and 6 kept
    damage(run_dir / "checkpoints" / "expert-shards-00000006")
    trainer, err = _run(corpus, run_dir, resume=True)
    assert "corrupt" in err and "trying the previous checkpoint" in err
    assert trainer.resumed_from.endswith("ckpt_00000004.safetensors")
    for a, b in zip(_records(run_dir), straight, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            assert a.get(key) == b.get(key), (key, a["step"])
