"""Token .bin files (issue 14): the dtype from a NAME.bin.json sidecar or data.token_dtype, each
refusal (no dtype, contradicting dtypes, torn size, ids past the vocabulary, negative ids, an
unknown vocabulary, a malformed sidecar), several files joined in the cache; and `moescale train`
end to end on a nanoGPT-style uint16 .bin and on a tokenizer + text folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import corpus_texts, save_tokenizer_json
from train_helpers import TINY, as_argv

from moescale.cli import main
from moescale.train.config import DataSection
from moescale.train.data import load_data
from moescale.train.token_files import SCAN_BLOCK, scan_ids, write_sidecar

GPT2_VOCAB = 50257


def nanogpt_bin(path, n=6000, seed=0):
    """GPT-2-sized ids as uint16 with no sidecar, the way nanoGPT's prepare.py writes them."""
    ids = np.random.default_rng(seed).integers(0, GPT2_VOCAB, n).astype(np.uint16)
    ids.tofile(path)
    return ids


def data(path, **kw):
    return DataSection(path=str(path), **kw)


def test_sidecar_dtype_reads_the_ids(tmp_path):
    ids = nanogpt_bin(tmp_path / "train.bin")
    write_sidecar(tmp_path / "train.bin", "uint16", GPT2_VOCAB)
    got = load_data(data(tmp_path / "train.bin"), tmp_path)
    assert got.vocab_size == GPT2_VOCAB and got.train.dtype == np.uint16
    assert np.array_equal(np.concatenate([got.train, got.val]), ids)
    assert got.tokenizer is None             # ids only: no tokenizer to decode them
    same = load_data(data(tmp_path / "train.bin", token_dtype="uint16"), tmp_path)
    assert np.array_equal(same.train, got.train)
    padded = load_data(data(tmp_path / "train.bin", vocab_size=50304), tmp_path)
    assert padded.vocab_size == 50304


def test_explicit_dtype_without_sidecar(tmp_path):
    ids = nanogpt_bin(tmp_path / "t.bin")
    got = load_data(data(tmp_path / "t.bin", token_dtype="uint16", vocab_size=GPT2_VOCAB),
                    tmp_path)
    assert np.array_equal(np.concatenate([got.train, got.val]), ids)
    np.arange(3000, dtype=np.uint8).tofile(tmp_path / "b.bin")
    legacy = load_data(data(tmp_path / "b.bin", token_dtype="uint8"), tmp_path)   # old configs
    assert legacy.vocab_size == 256 and legacy.tokenizer.decode([104, 105]) == "hi"


@pytest.mark.parametrize("kw, words", [
    ({}, ["no sidecar", "t.bin.json", "--data.token_dtype", "uint16"]),
    ({"token_dtype": "uint16"}, ["vocabulary size", "unknown", "--data.vocab_size"]),
    ({"token_dtype": "uint32", "vocab_size": GPT2_VOCAB},
     ["token id", f">= the vocabulary size {GPT2_VOCAB}"]),
    ({"token_dtype": "uint16", "vocab_size": 1000}, ["token id", ">= the vocabulary size 1000",
                                                     "data.vocab_size=1000"]),
])
def test_bin_refusals_without_sidecar(tmp_path, kw, words):
    nanogpt_bin(tmp_path / "t.bin")
    with pytest.raises(ValueError) as err:
        load_data(data(tmp_path / "t.bin", **kw), tmp_path)
    for word in words:
        assert word in str(err.value)


def test_wrong_dtype_against_the_sidecar_is_refused(tmp_path):
    nanogpt_bin(tmp_path / "t.bin")
    write_sidecar(tmp_path / "t.bin", "uint16", GPT2_VOCAB)
    for wrong in ("uint8", "uint32", "int32"):
        with pytest.raises(ValueError, match=f"data.token_dtype='{wrong}' contradicts the "
                                             "sidecar .*'uint16'"):
            load_data(data(tmp_path / "t.bin", token_dtype=wrong), tmp_path)


def test_torn_size_negative_ids_and_bad_sidecars(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    with pytest.raises(ValueError, match="3 bytes, not a whole number of uint16"):
        load_data(data(tmp_path / "odd.bin", token_dtype="uint16"), tmp_path)
    np.array([5, -7, 9] * 100, dtype=np.int32).tofile(tmp_path / "neg.bin")
    with pytest.raises(ValueError, match="token id -7 < 0"):
        load_data(data(tmp_path / "neg.bin", token_dtype="int32", vocab_size=10), tmp_path)
    nanogpt_bin(tmp_path / "s.bin")
    write_sidecar(tmp_path / "s.bin", "uint16", 1000)          # the sidecar undersells the ids
    with pytest.raises(ValueError, match=r">= the vocabulary size 1000 \(the .bin sidecar\)"):
        load_data(data(tmp_path / "s.bin"), tmp_path)
    for bad in ('{"dtype": "float32"}', "[1, 2]", "{oops",
                '{"dtype": "uint16", "vocab_size": 1}'):
        (tmp_path / "s.bin.json").write_text(bad)
        with pytest.raises(ValueError, match="sidecar .*s.bin.json"):
            load_data(data(tmp_path / "s.bin"), tmp_path)


def test_several_bins_are_joined_once_in_the_cache(tmp_path):
    a, b = nanogpt_bin(tmp_path / "a.bin", 3000, 1), nanogpt_bin(tmp_path / "b.bin", 2000, 2)
    for name in ("a.bin", "b.bin"):
        write_sidecar(tmp_path / name, "uint16", GPT2_VOCAB)
    cache = tmp_path / "cache"
    got = load_data(DataSection(path=f"{tmp_path / 'a.bin'},{tmp_path / 'b.bin'}",
                                cache_dir=str(cache)), tmp_path)
    assert np.array_equal(np.concatenate([got.train, got.val]), np.concatenate([a, b]))
    joined = list(cache.glob("bins-*.bin"))
    assert len(joined) == 1 and json.loads(joined[0].with_name(joined[0].name + ".json")
                                           .read_text())["tokens"] == 5000
    write_sidecar(tmp_path / "b.bin", "uint32", GPT2_VOCAB)
    (tmp_path / "b.bin").write_bytes(np.zeros(1000, np.uint32).tobytes())
    with pytest.raises(ValueError, match="different dtypes"):
        load_data(DataSection(path=f"{tmp_path / 'a.bin'},{tmp_path / 'b.bin'}"), cache)
    # a folder of .bin files with their sidecars is tokens, not text
    (tmp_path / "sub").mkdir()
    a.tofile(tmp_path / "sub" / "x.bin")
    write_sidecar(tmp_path / "sub" / "x.bin", "uint16", GPT2_VOCAB)
    got = load_data(DataSection(path=str(tmp_path / "sub")), cache)
    assert len(got.train) + len(got.val) == 3000


def test_scan_reads_in_blocks():
    ids = np.zeros(SCAN_BLOCK * 2 + 5, dtype=np.uint16)
    ids[SCAN_BLOCK + 3], ids[-1] = 7, 9
    assert scan_ids(ids) == (0, 9)


def test_config_defaults_and_checks():
    cfg = DataSection()
    assert cfg.token_dtype == "" and cfg.vocab_size == 0 and cfg.tokenizer == ""
    for kw, words in (({"token_dtype": "float32"}, "data.token_dtype='float32'"),
                      ({"vocab_size": 1}, "data.vocab_size=1"),
                      ({"text_column": " "}, "data.text_column")):
        with pytest.raises(ValueError, match=words):
            DataSection(**kw)


def _train(tmp_path, capsys, *extra):
    argv = ["train", *as_argv(dict(TINY, **{"model.n_layers": "1", "train.steps": "3",
                                            "train.run_dir": str(tmp_path / "run"),
                                            "train.sample_tokens": "8",
                                            "data.cache_dir": str(tmp_path / "cache")})), *extra]
    code = main(argv)
    return code, capsys.readouterr()


@pytest.mark.slow
def test_nanogpt_uint16_bin_trains_and_the_wrong_dtype_is_refused(tmp_path, capsys):
    nanogpt_bin(tmp_path / "train.bin", 20000)
    code, out = _train(tmp_path, capsys, "--data.path", str(tmp_path / "train.bin"),
                       "--data.token_dtype", "uint16", "--data.vocab_size", str(GPT2_VOCAB))
    assert code == 0, out.err
    assert "(token .bin, uint16): 19,000 train / 1,000 validation tokens" in out.out
    config = (tmp_path / "run" / "config.toml").read_text()
    assert 'token_dtype = "uint16"' in config and f"vocab_size = {GPT2_VOCAB}" in config
    code, out = _train(tmp_path / "again", capsys, "--data.path", str(tmp_path / "train.bin"))
    assert code == 2 and "no sidecar" in out.err and "--data.token_dtype" in out.err
    write_sidecar(tmp_path / "train.bin", "uint16", GPT2_VOCAB)
    code, out = _train(tmp_path / "wrong", capsys, "--data.path", str(tmp_path / "train.bin"),
                       "--data.token_dtype", "uint8")
    assert code == 2 and "contradicts the sidecar" in out.err


@pytest.mark.slow
def test_moescale_train_with_a_tokenizer_on_a_text_folder(corpus, tmp_path):
    """The real command: a BPE trained here, saved as tokenizer.json, and a folder of text."""
    import subprocess
    import sys

    tok = save_tokenizer_json(corpus_texts(corpus), tmp_path / "tok", vocab_size=300)
    overrides = dict(TINY, **{"model.n_layers": "1", "train.steps": "3",
                              "train.run_dir": str(tmp_path / "run"),
                              "train.sample_tokens": "16",
                              "data.cache_dir": str(tmp_path / "cache")})
    proc = subprocess.run([sys.executable, "-m", "moescale", "train", "--data.tokenizer",
                           str(tok), "--data.path", str(corpus), *as_argv(overrides)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"tokens: {tok} (vocabulary 300)" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3
    config = (tmp_path / "run" / "config.toml").read_text()
    assert f'tokenizer = "{tok}"' in config and "vocab_size = 0" in config
    assert len(list((tmp_path / "cache").glob("tok-*.bin.json"))) == 2
