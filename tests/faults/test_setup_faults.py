"""Set-up faults and API misuse of the issue-31 audit (items 5, 7, 10 and 11), one test each:
every one gave a traceback, a misleading exit or a silent wrong answer before.

- set-up OS errors (an over-long run directory name, a cache directory that is a file) exit 2
  with one line and no `--resume` advice for a run that never started (before: exit 1, "continue
  with --resume");
- `--model.moe_every 0` ("0 builds a dense model") trains, checkpoints and resumes (before: the
  first checkpoint failed);
- a huge balance-loss coefficient skips every step: the run ends with exit 3, not 0;
- a garbage metrics.jsonl does not block `--resume` (before: a codec error naming no file);
- a valid checkpoint of another model is passed over for the previous one (before: refused);
- API: an expert of the wrong width, token ids outside the vocabulary, an infinite capacity
  factor raise ValueError naming the values (before: a wrong-shape output, a bare IndexError,
  an OverflowError).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from fault_helpers import losses, tiny_args
from torch import nn

import moescale
from moescale.cli import main
from moescale.models import GPT, GPTConfig
from moescale.train.checkpoint import list_checkpoints


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("what", ["long-run-dir", "cache-dir-a-file"])
def test_setup_errors_exit_2_without_resume_advice(what, corpus, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    extra = {"long-run-dir": {"train__run_dir": str(tmp_path / ("x" * 300))},
             "cache-dir-a-file": {"data__cache_dir": str(tmp_path / "afile")}}[what]
    run = extra.pop("train__run_dir", str(tmp_path / "run"))
    code = main(["train", *tiny_args(corpus, run, train__steps="1", **extra)])
    err = capsys.readouterr().err
    assert code == 2 and len(_lines(err)) == 1 and "Traceback" not in err, err
    assert "--resume" not in err and ("too long" in err or "is a file" in err), err


@pytest.mark.slow
def test_moe_every_0_trains_checkpoints_and_resumes(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_args(corpus, run, train__steps="4", model__moe_every="0",
                                     train__checkpoint_interval="2")]) == 0, \
        capsys.readouterr().err
    assert [s for s, _ in list_checkpoints(run / "checkpoints")][-1] == 4
    assert main(["train", "--resume", str(run), "--train.steps", "6"]) == 0
    assert [r[0] for r in losses(run)] == list(range(1, 7))
    code = main(["train", *tiny_args(corpus, tmp_path / "disk", model__moe_every="0",
                                     offload__tier="disk")])
    err = capsys.readouterr().err
    assert code == 2 and "model.moe_every=0" in _lines(err)[-1] and "Traceback" not in err


def test_a_run_whose_every_step_is_skipped_exits_3(corpus, tmp_path, capsys):
    code = main(["train", *tiny_args(corpus, tmp_path / "run", train__steps="2",
                                     model__aux_loss_coef="1e308")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "every one of the 2 steps run" in _lines(err)[-1], err


@pytest.mark.slow
def test_garbage_metrics_and_another_models_checkpoint_do_not_block_resume(corpus, tmp_path,
                                                                          capsys):
    run, other = tmp_path / "run", tmp_path / "other"
    assert main(["train", *tiny_args(corpus, run, train__steps="4",
                                     train__checkpoint_interval="2")]) == 0
    assert main(["train", *tiny_args(corpus, other, train__steps="6",
                                     model__d_model="64")]) == 0
    capsys.readouterr()
    (run / "checkpoints" / "ckpt_00000006.safetensors").write_bytes(
        (other / "checkpoints" / "ckpt_00000006.safetensors").read_bytes())
    for dense in (other / "checkpoints").glob("dense-00000006-*"):   # its DCP dense half too
        shutil.copytree(dense, run / "checkpoints" / dense.name)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe garbage \x00\n")
    assert main(["train", "--resume", str(run), "--train.steps", "6"]) == 0
    err = capsys.readouterr().err
    assert "ckpt_00000006.safetensors' does not fit this model" in err
    assert "resumed from" in err and "ckpt_00000004" in err
    assert [r[0] for r in losses(run)] == list(range(1, 7))


def test_api_misuse_raises_value_errors_naming_the_values():
    moe = moescale.MoE(d_model=8, experts=[nn.Linear(8, 4), nn.Linear(8, 4)], top_k=1)
    with pytest.raises(ValueError, match=r"expert \d \(Linear\) maps .* d_model=8"):
        moe(torch.randn(3, 8))
    gpt = GPT(GPTConfig.from_flat(vocab_size=16, seq_len=8, n_layers=1, d_model=16, n_heads=2,
                                  num_experts=2, top_k=1))
    with pytest.raises(ValueError, match=r"\[1, 20\] but the vocabulary is \[0, 16\)"):
        gpt(torch.tensor([[1, 20]]))
    with pytest.raises(ValueError, match="capacity_factor=inf must be a finite number"):
        moescale.MoE(d_model=8, num_experts=2, d_ff=8, capacity_factor=float("inf"))
    huge = moescale.MoE(d_model=8, num_experts=2, d_ff=8, capacity_factor=1e308)
    assert huge(torch.randn(5, 8)).shape == (5, 8) and huge.last_stats.num_dropped == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_shm_directory_that_is_a_file_stops_every_rank_in_one_line(launcher, corpus,
                                                                     tmp_path):
    """$MOESCALE_SHM_DIR naming a file (before: rank 0 failed alone, exit 1 with resume advice,
    rank 1 waited for the collective's timeout): every rank refuses at once, exit 2."""
    from fault_helpers import rank_env

    from moescale.parallel.launch import free_port

    (tmp_path / "afile").write_text("x")
    port = free_port()
    argv = ["train", *tiny_args(corpus, tmp_path / "run", train__steps="2",
                                parallel__placement="dynamic")]
    shm = {"MOESCALE_SHM_DIR": str(tmp_path / "afile")}
    ranks = [launcher.start(argv, tmp_path, log=tmp_path / f"rank{r}.log",
                            env=dict(rank_env(r, 2, port), **shm)) for r in range(2)]
    codes = [r.wait(90) for r in ranks]
    for rank, code in zip(ranks, codes):
        lines = _lines(rank.text())
        assert code == 2 and "MOESCALE_SHM_DIR" in lines[-1], rank.text()
        assert "Traceback" not in rank.text() and "--resume" not in lines[-1]
