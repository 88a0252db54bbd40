"""`moescale train` through the real command line: a short run in a subprocess leaves the run
directory; bad input gives one line, exit code 2 and no traceback; SIGINT saves a checkpoint,
exits cleanly, and the resumed run logs the losses of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import matplotlib.image
import pytest

from moescale.cli import main as moescale_main
from moescale.train.checkpoint import list_checkpoints, load_checkpoint
from moescale.train.config import load_config
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import TINY, as_argv, moescale_cmd, small_corpus


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_short_run_through_the_cli_leaves_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    args = as_argv(dict(TINY, **{"train.steps": "4", "train.eval_interval": "2",
                                 "train.sample_tokens": "16", "train.report": "true",
                                 "train.run_dir": str(run_dir)}))
    proc = subprocess.run(moescale_cmd("train", *args), capture_output=True, text=True,
                          timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "val loss" in proc.stdout and "offload plan: device-only" in proc.stdout
    assert "Python" in proc.stdout            # the built-in corpus: the standard library
    config = load_config(run_dir / "config.toml")
    assert config.model.d_model == 32 and config.model.n_layers == 2
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert len(train[0]["tokens_per_expert"]) == 2 and len(train[0]["tokens_per_expert"][0]) == 4
    assert sum(train[0]["tokens_per_expert"][0]) == 4 * 32 * 2      # B * S * top_k
    assert [r["step"] for r in records if r["kind"] == "val"] == [2, 4]
    (step, ckpt), = list_checkpoints(run_dir / "checkpoints")
    assert step == 4 and load_checkpoint(ckpt)[1]["step"] == 4
    image = matplotlib.image.imread(run_dir / "report.png")
    assert image.shape[0] > 300 and image.shape[1] > 300
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["offload_plan"] == "device-only" and summary["val_loss"] > 0


@pytest.mark.parametrize("args, words", [
    (["--bogus", "1"], ["unknown option", "--bogus"]),
    (["--model.nonsense", "1"], ["unknown option", "model.nonsense"]),
    (["--model.num_experts", "-4"], ["model.num_experts", "-4"]),
    (["--model.num_experts", "4", "--model.top_k", "6"], ["top_k", "6"]),
    (["--model.top_k", "9"], ["top_k=9", "num_experts=8"]),
    (["--train.steps"], ["needs a value"]),
    (["--parallel.placement", "dynamic"], ["parallel.placement='dynamic'", "torchrun"]),
    (["--parallel.placement", "dynamic", "--offload.mode", "pin"], ["offload.tier device-only"]),
    (["--parallel.ep_size", "2"], ["parallel.ep_size=2", "torchrun"]),          # one process
    (["--parallel.ep_size", "3", "--model.num_experts", "8"], ["does not divide"]),
    (["--offload.mode", "host", "--offload.device_budget_experts", "0.5"],
     ["offload.tier='host'", "below one expert"]),
    (["--offload.mode", "host", "--offload.device_budget", "1KiB"], ["below one expert"]),
    (["--offload.mode", "auto", "--offload.device_budget", "1KiB", "--offload.rates", "a100"],
     ["no offloading mode fits"]),
    (["--offload.device_budget", "1KiB"], ["device_budget", "too small"]),
    (["--config", "/no/such/file.toml"], ["does not exist"]),
    (["--resume", "/no/such/run"], ["--resume", "config.toml"]),
])
def test_bad_input_is_one_line_and_exit_2(args, words, tmp_path, capsys):
    corpus = small_corpus(tmp_path / "corpus", num_files=4)
    argv = ["train", "--data.path", str(corpus), "--train.run_dir", str(tmp_path / "r"), *args]
    assert moescale_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err


def test_missing_and_empty_data_paths(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "nothing.txt").write_text("")
    for path, word in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "empty")):
        assert moescale_main(["train", "--data.path", str(path),
                              "--train.run_dir", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and word in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_in_a_real_process(tmp_path):
    proc = subprocess.run(moescale_cmd("train", "--model.num_experts", "-1"), capture_output=True,
                          text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moescale train: error: model.num_experts=-1 is invalid: must be >= 1"]
    assert not (tmp_path / "runs").exists()


def test_help_lists_options(capsys):
    assert moescale_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model.num_experts" in out and "tiny: 8" in out and "--resume" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigint_saves_a_checkpoint_and_resume_continues_exactly(tmp_path):
    corpus = small_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    overrides = dict(TINY, **{"data.path": str(corpus), "train.steps": "5000",
                              "train.eval_interval": "0", "train.checkpoint_interval": "0"})
    proc = subprocess.Popen(moescale_cmd("train", *as_argv(overrides), "--train.run_dir",
                                         str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    deadline = time.monotonic() + 150
    while len(read_metrics(run_dir / "metrics.jsonl")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in out
    stopped = list_checkpoints(run_dir / "checkpoints")[-1][0]   # (step 0's kept: trust.py)
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert stopped >= 3 and logged == list(range(1, stopped + 1))

    until = stopped + 3
    resumed = Trainer(load_config(run_dir / "config.toml"), run_dir, resume=True,
                      out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    assert resumed.run(until_step=until) == 0
    straight_dir = tmp_path / "straight"
    straight = Trainer(load_config(None, dict(overrides, **{"train.run_dir": str(straight_dir)})),
                       straight_dir, out=open(os.devnull, "w"))
    assert straight.run(until_step=until) == 0

    def losses(d):
        return [(r["step"], r["loss"], r["grad_norm"], r["tokens_per_expert"])
                for r in read_metrics(d / "metrics.jsonl")]
    assert losses(run_dir) == losses(straight_dir)
    assert len(losses(run_dir)) == until


def test_info_reports_versions_devices_memory_and_disk(capsys):
    assert moescale_main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("moescale:", "torch:", "devices:", "cpus:", "ram_total:", "disk_free_cwd:"):
        assert key in out
