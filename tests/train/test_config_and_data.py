"""Config tree (TOML + dotted overrides, types, errors, help) and data (split, .bin, batches)."""

from __future__ import annotations

import numpy as np
import pytest

from moescale.toml_compat import tomllib
from moescale.train.assembly import check_parts
from moescale.train.config import RunConfig, help_text, load_config, to_toml
from moescale.train.data import TokenBatches, is_validation, load_data
from moescale.train.config import DataSection


def test_toml_then_overrides_with_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nnum_experts = 16\n[train]\nsteps = 50\nprogress = false\n'
                    '[optim]\nlr = 0.01\n')
    cfg = load_config(path, {"model.num_experts": "32", "train.precision": "bf16",
                             "model.capacity_factor": "1.25", "optim.lr": "2e-3",
                             "train.progress": "true"})
    assert cfg.model.num_experts == 32 and cfg.train.steps == 50
    assert cfg.model.capacity_factor == 1.25 and cfg.optim.lr == 2e-3
    assert cfg.train.precision == "bf16" and cfg.train.progress is True
    again = load_config(None, base=tomllib.loads(to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("overrides, words", [
    ({"model.bogus": "1"}, ["unknown option", "model.bogus"]),
    ({"nosection.x": "1"}, ["unknown option", "nosection.x"]),
    ({"model.num_experts": "-2"}, ["model.num_experts", "-2"]),
    ({"model.num_experts": "4", "model.top_k": "5"}, ["model.top_k", "5"]),
    ({"train.steps": "ten"}, ["train.steps", "not an integer"]),
    ({"train.progress": "maybe"}, ["train.progress", "boolean"]),
    ({"optim.lr": "nan"}, ["optim.lr"]),
    ({"offload.device_budget": "12 parsecs"}, ["offload.device_budget"]),
    ({"model.router": "psychic"}, ["model.router", "topk"]),
])
def test_bad_values_name_the_option(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_unsupported_combinations_are_refused_by_their_part_not_ignored():
    for overrides, words in (
            ({"offload.mode": "host", "parallel.ep_size": "2", "parallel.reuse": "S1"},
             "reuse none, S2, S4 or auto"),
            ({"offload.mode": "auto", "offload.device_budget": "1MiB",
              "parallel.ep_size": "2"}, "offload.mode host, pin or disk"),
            ({"parallel.placement": "dynamic", "offload.mode": "pin"}, "offload.mode device-only"),
            ({"parallel.placement": "dynamic", "parallel.ep_size": "2"}, "conflicts"),
            ({"parallel.placement": "dynamic", "parallel.chunks": "2"}, "pipelined"),
            ({"parallel.placement": "dynamic", "train.precision": "bf16"}, "fp32"),
            ({"parallel.placement": "dynamic", "train.device": "cuda"}, "train.device cpu"),
            ({"parallel.split": "false"}, "applies to parallel.placement dynamic"),
            ({"parallel.chunks": "4"}, "needs expert parallelism"),
            ({"parallel.reuse": "S1"}, "needs expert parallelism"),
            ({"offload.mode": "host", "offload.step_mode": "eager"}, "optim.grad_clip"),
            ({"offload.mode": "auto"}, "needs offload.device_budget")):
        cfg = load_config(None, overrides)          # valid values ...
        with pytest.raises(ValueError, match=words):
            check_parts(cfg)                        # ... that cannot run together
    check_parts(RunConfig())
    for ok in ({"offload.mode": "host"}, {"offload.mode": "disk"},
               {"offload.mode": "host", "offload.step_mode": "eager", "optim.grad_clip": "0"},
               {"parallel.ep_size": "2", "parallel.chunks": "auto", "parallel.reuse": "auto"},
               {"offload.mode": "auto", "offload.device_budget": "1MiB"},
               {"offload.mode": "disk", "parallel.ep_size": "2"},
               {"offload.mode": "disk", "parallel.ep_size": "2", "parallel.chunks": "2"},
               {"offload.mode": "host", "parallel.ep_size": "2", "parallel.chunks": "auto",
                "parallel.reuse": "auto"},
               {"parallel.placement": "dynamic", "parallel.split": "false"}):
        check_parts(load_config(None, ok))


def test_offload_and_parallel_values_are_validated():
    for overrides, words in (({"parallel.chunks": "0"}, "parallel.chunks"),
                             ({"parallel.chunks": "many"}, "parallel.chunks"),
                             ({"parallel.reuse": "S9"}, "parallel.reuse"),
                             ({"offload.step_mode": "lazy"}, "offload.step_mode"),
                             ({"offload.activation_policy": "drop"}, "activation_policy"),
                             ({"offload.device_budget_experts": "0"}, "device_budget_experts"),
                             ({"offload.device_budget": "1MiB",
                               "offload.device_budget_experts": "2"}, "not both"),
                             ({"offload.host_cache": "lots"}, "offload.host_cache")):
        with pytest.raises(ValueError, match=words):
            load_config(None, overrides)
    # TOML integers are accepted for string options such as chunks or a byte budget
    assert load_config(None, None, base={"parallel": {"chunks": 3}}).parallel.chunk_count() == 3


def test_help_lists_every_option_with_its_default():
    text = help_text()
    for option in ("--model.num_experts", "--model.top_k", "--model.router",
                   "--model.capacity_factor", "--offload.mode", "--offload.device_budget",
                   "--parallel.ep_size", "--parallel.chunks", "--parallel.reuse",
                   "--parallel.placement", "--parallel.split",
                   "--offload.step_mode", "--offload.activation_policy", "--offload.host_cache",
                   "--offload.disk_dir", "--offload.device_budget_experts",
                   "--train.precision", "--train.batch_size", "--train.seq_len", "--train.steps",
                   "--optim.schedule", "--train.seed", "--data.path"):
        assert option in text
    assert "default 'device-only'" in text


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}\n" * 50)
    cfg = DataSection(path=str(tmp_path), val_fraction=0.2)
    a, b = load_data(cfg, tmp_path / "cache"), load_data(cfg, tmp_path / "cache")
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    val_files = [i for i in range(40) if is_validation(f"f{i:02d}.txt", 0.2)]
    assert 0 < len(val_files) < 40
    val_text = bytes(a.val).decode()
    for i in range(40):
        assert (f"file {i}\n" in val_text) == (i in val_files)
    assert len(a.train) + len(a.val) == sum(len(f"file {i}\n") * 50 for i in range(40))


def test_token_bin_and_vocab_check(tmp_path):
    tokens = (np.arange(5000) % 1000).astype(np.uint16)
    path = tmp_path / "toks.bin"
    tokens.tofile(path)
    data = load_data(DataSection(path=str(path), token_dtype="uint16", vocab_size=1000), tmp_path)
    assert data.vocab_size == 1000 and len(data.train) + len(data.val) == 5000
    assert np.array_equal(np.concatenate([data.train, data.val]), tokens)
    with pytest.raises(ValueError, match="vocab_size"):
        load_data(DataSection(path=str(path), token_dtype="uint16", vocab_size=500), tmp_path)


def test_missing_and_empty_data_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_data(DataSection(path=str(tmp_path / "nope.txt")), tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        load_data(DataSection(path=str(tmp_path / "empty")), tmp_path)


def test_batches_resume_from_generator_state():
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    a = TokenBatches(tokens, 3, 16, seed=7, split="train")
    for _ in range(3):
        a.next()
    state = a.state()
    expected = [a.next() for _ in range(3)]
    b = TokenBatches(tokens, 3, 16, seed=7, split="train")
    b.load_state(__import__("json").loads(__import__("json").dumps(state)))
    for (x1, y1), (x2, y2) in zip(expected, [b.next() for _ in range(3)]):
        assert x1.equal(x2) and y1.equal(y2)
        assert x1[:, 1:].equal(y1[:, :-1])
