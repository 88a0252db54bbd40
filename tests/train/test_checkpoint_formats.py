"""Checkpoints of the format before DCP (format 2: the dense half whole in the commit file)
still resume and load.

fixtures/format2_run/run is a real run directory written by moescale before the dense half went
through torch.distributed.checkpoint (commit f62ced3: `moescale train` with --model.n_layers 2
--model.d_model 16 --model.n_heads 2 --model.d_ff 32 --model.num_experts 4 --model.top_k 2
--train.batch_size 4 --train.seq_len 16 --train.eval_batches 1 --train.threads 1
--optim.warmup_steps 2 --data.path corpus --train.steps 6 --train.checkpoint_interval 3
--train.keep_last 2 --train.eval_interval 0, in fixtures/format2_run), with the checkpoint of
step 6 and the export removed: its checkpoint of step 3 and the losses of all 6 steps remain.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moescale.cli import main
from moescale.train.checkpoint import checkpoint_path, load_checkpoint
from moescale.train.load_run import load_run

FIXTURE = Path(__file__).parent / "fixtures" / "format2_run"


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def test_a_format_2_checkpoint_resumes_with_the_old_runs_losses(tmp_path, monkeypatch):
    shutil.copytree(FIXTURE, tmp_path / "fx")
    monkeypatch.chdir(tmp_path / "fx")          # the run's data.path is relative: corpus
    run = Path("run")
    old = _losses(run)
    assert [s for s, _ in old] == [1, 2, 3, 4, 5, 6]
    assert load_checkpoint(checkpoint_path(run / "checkpoints", 3))[1]["format"] == 2
    before = load_run(run, step=3)[0].state_dict()
    assert main(["train", "--resume", str(run)]) == 0
    assert _losses(run) == old                  # steps 4-6 of the old code, bit for bit
    _, state = load_checkpoint(checkpoint_path(run / "checkpoints", 6))
    assert state["format"] == 3 and (run / "checkpoints" / state["dense"]["dir"]).is_dir()
    after = load_run(run, step=3)[0].state_dict()         # the old one still loads as it did
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert load_run(run)[0].state_dict().keys() == before.keys()     # the new one, whole
