"""Config tree (TOML + dotted overrides, types, errors, help) and data (split, .bin, batches)."""

from __future__ import annotations

import numpy as np
import pytest

from moescale.toml_compat import tomllib
from moescale.train.assembly import check_parts
from moescale.train.config import RunConfig, help_text, load_config, to_toml
from moescale.train.corpus import is_validation
from moescale.train.data import TokenBatches, load_data
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
    ({"offload.device_budget_bytes": "12 parsecs"}, ["offload.device_budget_bytes"]),
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
            ({"offload.tier": "host", "parallel.ep_size": "2", "parallel.reuse": "S1"},
             "reuse none, S2, S4 or auto"),
            ({"offload.tier": "auto", "offload.device_budget_bytes": "1MiB",
              "parallel.ep_size": "2"}, "offload.tier host, pin or disk"),
            ({"parallel.placement": "dynamic", "offload.tier": "pin"}, "offload.tier device-only"),
            ({"parallel.placement": "dynamic", "parallel.ep_size": "2"}, "conflicts"),
            ({"parallel.placement": "dynamic", "parallel.chunks": "2"}, "pipelined"),
            ({"parallel.placement": "dynamic", "train.precision": "bf16"}, "fp32"),
            ({"parallel.placement": "dynamic", "train.device": "cuda"}, "train.device cpu"),
            ({"parallel.split": "false"}, "applies to parallel.placement dynamic"),
            ({"parallel.chunks": "4"}, "needs expert parallelism"),
            ({"parallel.reuse": "S1"}, "needs expert parallelism"),
            ({"offload.tier": "host", "offload.step_mode": "eager"}, "optim.grad_clip"),
            ({"offload.tier": "auto"}, "needs offload.device_budget_bytes")):
        cfg = load_config(None, overrides)          # valid values ...
        with pytest.raises(ValueError, match=words):
            check_parts(cfg)                        # ... that cannot run together
    check_parts(RunConfig())
    for ok in ({"offload.tier": "host"}, {"offload.tier": "disk"},
               {"offload.tier": "host", "offload.step_mode": "eager", "optim.grad_clip": "0"},
               {"parallel.ep_size": "2", "parallel.chunks": "auto", "parallel.reuse": "auto"},
               {"offload.tier": "auto", "offload.device_budget_bytes": "1MiB"},
               {"offload.tier": "disk", "parallel.ep_size": "2"},
               {"offload.tier": "disk", "parallel.ep_size": "2", "parallel.chunks": "2"},
               {"offload.tier": "host", "parallel.ep_size": "2", "parallel.chunks": "auto",
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
                             ({"offload.device_budget_bytes": "1MiB",
                               "offload.device_budget_experts": "2"}, "not both"),
                             ({"offload.host_cache_bytes": "lots"}, "offload.host_cache_bytes"),
                             ({"offload.tier": "ram"}, "offload.tier='ram' is unknown"),
                             ({"offload.compute_dtype": "bfloat16"}, "train.precision")):
        with pytest.raises(ValueError, match=words):
            load_config(None, overrides)
    # TOML integers and words are accepted for chunks (a count or 'auto')
    assert load_config(None, None, base={"parallel": {"chunks": 3}}).parallel.chunks == 3
    assert load_config(None, {"parallel.chunks": "auto"}).parallel.chunks == "auto"


def test_run_sections_are_the_library_configs_and_old_names_still_load():
    from moescale.offload import OffloadConfig
    from moescale.parallel.groups import ParallelConfig
    cfg = load_config(None, {"offload.mode": "disk", "offload.device_budget": "1MiB",
                             "offload.host_cache": "4MiB", "offload.disk_dir": "/tmp/x",
                             "parallel.memory_limit": "2GiB"})
    assert type(cfg.offload) is OffloadConfig and type(cfg.parallel) is ParallelConfig
    assert (cfg.offload.tier, cfg.offload.device_budget_bytes, cfg.offload.host_cache_bytes,
            cfg.offload.directory) == ("disk", 1 << 20, 4 << 20, "/tmp/x")
    assert cfg.parallel.memory_limit_bytes == 2 << 30
    # the run's defaults of the library's sections, and their resolved TOML (new names only)
    assert (RunConfig().offload.tier, RunConfig().offload.step_mode) == ("device-only",
                                                                         "deferred")
    text = to_toml(cfg)
    assert "tier = \"disk\"" in text and "device_budget_bytes = 1048576" in text
    assert "\nmode" not in text and "compute_dtype" not in text
    assert load_config(None, None, base=tomllib.loads(text)).offload == cfg.offload


def test_help_lists_every_option_with_its_default():
    text = help_text()
    for option in ("--model.num_experts", "--model.top_k", "--model.router",
                   "--model.capacity_factor", "--offload.tier", "--offload.device_budget_bytes",
                   "--parallel.ep_size", "--parallel.chunks", "--parallel.reuse",
                   "--parallel.placement", "--parallel.split",
                   "--offload.step_mode", "--offload.activation_policy", "--offload.host_cache_bytes",
                   "--offload.directory", "--offload.device_budget_experts",
                   "--train.precision", "--train.batch_size", "--train.seq_len", "--train.steps",
                   "--optim.schedule", "--train.seed", "--data.path"):
        assert option in text
    assert "default 'device-only'" in text
    # each option's documentation is the comment after its field (the library's for offload)
    assert "experts uploaded ahead of the one computing" in text
    assert "--offload.compute_dtype" not in text    # derived from train.precision


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
