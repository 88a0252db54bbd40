"""Validation data of its own, and a run's config.toml as the start of a new run.

nanoGPT's `shakespeare_char` layout (train.bin + val.bin as uint16 without sidecars, meta.pkl
with the character table): the run trains on train.bin only and validates on val.bin only (no
token of val.bin ever appears in a training batch), takes the vocabulary size from meta.pkl
and its characters as the tokenizer (generate decodes text; the export's AutoTokenizer encodes
as meta.pkl's stoi). `--data.val_path` does the same for any data. A meta.pkl holding anything
but plain data is refused without running it. `--config RUN_DIR/config.toml` starts a new run
in a new directory."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from moescale import cli
from moescale.train.config import DataSection
from moescale.train.data import TokenBatches, load_data
from train_helpers import TINY, as_argv

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\n-&$3"))


def shakespeare_char(folder: Path) -> Path:
    """train.bin from the first 30 characters only, val.bin from the others (65 in all)."""
    folder.mkdir(parents=True)
    stoi = {c: i for i, c in enumerate(CHARS)}
    rng = np.random.default_rng(0)
    rng.integers(0, 30, 6000).astype(np.uint16).tofile(folder / "train.bin")
    rng.integers(30, len(CHARS), 1500).astype(np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(CHARS), "itos": {i: c for c, i in stoi.items()},
                     "stoi": stoi}, f)
    return folder


def test_nanogpt_val_bin_is_validation_only(tmp_path):
    folder = shakespeare_char(tmp_path / "shakespeare_char")
    data = load_data(DataSection(path=str(folder)), tmp_path / "cache")
    assert data.vocab_size == len(CHARS)
    assert len(data.train) == 6000 and int(data.train.max()) < 30
    assert len(data.val) == 1500 and int(data.val.min()) >= 30
    batches = TokenBatches(data.train, 8, 32, 0, "train")
    for _ in range(200):
        idx, targets = batches.next()
        assert int(idx.max()) < 30 and int(targets.max()) < 30


def test_a_nanogpt_char_run_decodes_and_exports_its_characters(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = shakespeare_char(tmp_path / "shakespeare_char")
    run_dir = tmp_path / "run"
    argv = as_argv(dict(TINY, **{"data.path": str(folder), "train.steps": "3",
                                 "train.run_dir": str(run_dir), "train.eval_interval": "3",
                                 "train.checkpoint_interval": "3"}))
    assert cli.main(["train", *argv]) == 0
    saved = (run_dir / "config.toml").read_text()
    assert f'tokenizer = "{folder / "meta.pkl"}"' in saved
    assert (run_dir / "tokenizer" / "meta.pkl").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf", trust_remote_code=True)
    assert tok("To be, or not")["input_ids"] == [CHARS.index(c) for c in "To be, or not"]
    assert tok.decode([CHARS.index(c) for c in "Hi!\n"]) == "Hi!\n"
    assert cli.main(["generate", str(run_dir), "--prompt", "To be", "--tokens", "4"]) == 0


def test_data_val_path_is_the_whole_validation_stream(corpus, tmp_path):
    val_file = tmp_path / "held_out.txt"
    val_file.write_text("validation text, only here\n" * 40)
    data = load_data(DataSection(path=str(corpus), val_path=str(val_file)), tmp_path / "cache")
    assert bytes(np.asarray(data.val, dtype=np.uint8)) == val_file.read_bytes()
    assert len(data.train) == sum(p.stat().st_size for p in corpus.iterdir())


def test_a_meta_pkl_that_would_run_code_is_refused(tmp_path):
    folder = shakespeare_char(tmp_path / "nano")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": Path("x")}))
    with pytest.raises(ValueError, match="meta.pkl refers to pathlib"):
        load_data(DataSection(path=str(folder)), tmp_path / "cache")


def test_a_runs_config_toml_starts_a_new_run(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    argv = as_argv(dict(TINY, **{"data.path": str(corpus), "train.steps": "2",
                                 "train.run_dir": str(first)}))
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["train", "--config", str(first / "config.toml")]) == 0
    (second,) = (tmp_path / "runs").iterdir()
    assert (second / "hf" / "config.json").is_file() and (second / "checkpoints").is_dir()
    assert (second / "config.toml").read_text() == (first / "config.toml").read_text()


def test_auto_threads_stay_auto_in_config_toml_and_resume_keeps_the_runs_choice(corpus,
                                                                                tmp_path):
    from moescale.train.checkpoint import list_checkpoints, load_checkpoint
    from moescale.train.config import load_config
    from moescale.train.trainer import Trainer

    run_dir = tmp_path / "run"
    argv = as_argv(dict(TINY, **{"data.path": str(corpus), "train.steps": "2",
                                 "train.threads": "0", "train.run_dir": str(run_dir)}))
    assert cli.main(["train", *argv]) == 0
    assert "threads = 0\n" in (run_dir / "config.toml").read_text()
    (_, path), = list_checkpoints(run_dir / "checkpoints")
    chosen = load_checkpoint(path)[1]["config"]["train"]["threads"]
    assert chosen >= 1
    config = load_config(run_dir / "config.toml", {"train.steps": "3"})
    resumed = Trainer(config, run_dir, resume=True)
    assert resumed.config.train.threads == chosen
    assert resumed.run() == 0
