"""Text corpora through `data.tokenizer`: tokenizer files, the cached token files, blocks, folders
and saved datasets (issue 14). Tokenizers are trained here on real text; nothing is downloaded."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from data_helpers import EOS, corpus_texts, save_tokenizer_json, save_vocab_merges

from moescale.train.config import DataSection, load_config
from moescale.train.corpus import file_blocks, is_validation
from moescale.train.data import load_data, stdlib_files
from moescale.train.token_files import read_sidecar
from moescale.train.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok_json(corpus, tmp_path_factory):
    return save_tokenizer_json(corpus_texts(corpus), tmp_path_factory.mktemp("tok"))


def test_load_tokenizer_json_dir_and_vocab_merges(corpus, tok_json, tmp_path):
    text = "def f(x):\n    return x + 1  # ünïcode\n"
    for path in (tok_json, tok_json.parent):
        tok = load_tokenizer(str(path))
        ids = tok.encode(text)
        assert tok.decode(ids) == text and len(ids) < len(text.encode())
        assert tok.vocab_size == 400 and tok.eos_id == tok.tokenizer.token_to_id(EOS)
    pair = save_vocab_merges(corpus_texts(corpus), tmp_path / "gpt2")
    for path in (pair, pair / "vocab.json"):
        bpe = load_tokenizer(str(path))
        assert bpe.decode(bpe.encode(text)) == text and bpe.vocab_size == 400
    assert bpe.fingerprint != load_tokenizer(str(tok_json)).fingerprint
    byte = load_tokenizer("")
    assert isinstance(byte, ByteTokenizer) and byte.encode("é") == [195, 169]
    assert byte.decode(byte.encode(text)) == text


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.json", "does not exist"),
    (lambda d: d, "no tokenizer.json"),
    (lambda d: (d / "t.json").write_text("{not json") and d / "t.json", "does not load"),
])
def test_bad_tokenizer_paths_are_value_errors(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=words) as err:
        load_tokenizer(str(path))
    assert "data.tokenizer" in str(err.value) and str(path) in str(err.value)


def test_tokenized_folder_is_cached_split_by_file_and_recorded(corpus, tok_json, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    for path in sorted(corpus.iterdir())[:8]:
        (small / path.name).write_bytes(path.read_bytes()[:6000])
    corpus = small
    cfg = DataSection(path=str(corpus), tokenizer=str(tok_json), val_fraction=0.3)
    data = load_data(cfg, tmp_path / "cache")
    tok = data.tokenizer
    assert data.vocab_size == 400 and data.train.dtype == np.uint16
    assert isinstance(data.train, np.memmap)
    files = sorted(p for p in corpus.rglob("*") if p.is_file())
    expect = {False: [], True: []}
    for p in files:
        expect[is_validation(p.name, 0.3)] += tok.encode(p.read_text()) + [tok.eos_id]
    assert expect[True] and data.val.tolist() == expect[True]
    assert data.train.tolist() == expect[False]
    bins = sorted((tmp_path / "cache").glob("tok-*.bin"))
    assert len(bins) == 2
    meta = read_sidecar(bins[0])
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 400
    assert meta["tokenizer"] == str(tok_json)
    mtimes = [p.stat().st_mtime_ns for p in bins]
    again = load_data(cfg, tmp_path / "cache")            # cached: nothing rewritten
    assert [p.stat().st_mtime_ns for p in bins] == mtimes
    assert np.array_equal(again.train, data.train)
    files[0].write_text(files[0].read_text() + "\n# edited\n")   # contents are the key
    load_data(cfg, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("tok-*.train.bin"))) == 2


def test_run_config_records_the_tokenizer_absolute(tok_json, monkeypatch):
    monkeypatch.chdir(tok_json.parent)
    cfg = load_config(None, {"data.tokenizer": "tokenizer.json"})
    assert cfg.data.tokenizer == str(tok_json)
    assert load_tokenizer(cfg.data.tokenizer).vocab_size == 400


def test_blocks_tokenize_like_whole_files(corpus, tok_json, tmp_path):
    tok = load_tokenizer(str(tok_json))
    count = 0
    for path in sorted(corpus.iterdir())[:10]:
        blocks = list(file_blocks(path, 500))
        assert b"".join(blocks) == path.read_bytes()
        ids = np.concatenate(tok.encode_blocks(blocks)).tolist()
        assert ids == tok.encode(path.read_text())
        count += len(blocks)
    assert count > 100
    odd = tmp_path / "one_line.txt"            # no blank to cut at: whole UTF-8 characters
    odd.write_text("é€𝄞" * 400)
    blocks = list(file_blocks(odd, 64))
    assert len(blocks) > 1 and b"".join(blocks) == odd.read_bytes()
    assert "".join(b.decode("utf-8") for b in blocks) == odd.read_text()


def test_folder_skips_hidden_binary_and_sidecars(tmp_path):
    root = tmp_path / "c"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("alpha " * 50)
    (root / "sub" / "b.md").write_text("beta " * 50)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".hidden.txt").write_text("secret\n")
    (root / "blob.dat").write_bytes(b"\0\1\2" * 10)
    data = load_data(DataSection(path=str(root)), tmp_path / "cache")
    text = bytes(np.concatenate([data.train, data.val])).decode()
    assert text == "alpha " * 50 + "beta " * 50 and data.vocab_size == 256


def test_smaller_vocab_than_the_tokenizer_is_refused_larger_pads(corpus, tok_json, tmp_path):
    with pytest.raises(ValueError, match="data.vocab_size=300 is smaller.*400"):
        load_data(DataSection(path=str(corpus), tokenizer=str(tok_json), vocab_size=300),
                  tmp_path)
    data = load_data(DataSection(path=str(corpus), tokenizer=str(tok_json), vocab_size=512),
                     tmp_path)
    assert data.vocab_size == 512 and data.tokenizer.vocab_size == 400


def _save_dataset(folder, rows, column="text", dict_splits=None):
    datasets = pytest.importorskip("datasets", reason="the datasets library is not installed")
    if dict_splits:
        datasets.DatasetDict({name: datasets.Dataset.from_dict({column: part})
                              for name, part in dict_splits.items()}).save_to_disk(str(folder))
    else:
        datasets.Dataset.from_dict({column: rows, "n": list(range(len(rows)))}
                                   ).save_to_disk(str(folder))
    return folder


@pytest.mark.slow      # importing datasets takes ~1.5 s
def test_saved_dataset_rows_split_by_row(tok_json, corpus, tmp_path):
    rows = [t[:3000] for t in corpus_texts(corpus)] + [""]
    folder = _save_dataset(tmp_path / "ds", rows, column="body")
    cfg = DataSection(path=str(folder), tokenizer=str(tok_json), text_column="body",
                      val_fraction=0.2)
    data = load_data(cfg, tmp_path / "cache")
    tok = data.tokenizer
    expect = {False: [], True: []}
    for i, row in enumerate(rows):
        if row:
            expect[is_validation(f"row {i}", 0.2)] += tok.encode(row) + [tok.eos_id]
    assert data.train.tolist() == expect[False] and data.val.tolist() == expect[True]
    with pytest.raises(ValueError, match="data.text_column='text'.*columns: body, n"):
        load_data(DataSection(path=str(folder)), tmp_path / "cache")
    with pytest.raises(ValueError, match="data.text_column='n'"):
        load_data(DataSection(path=str(folder), text_column="n"), tmp_path / "cache")
    with pytest.raises(ValueError, match="saved dataset"):
        load_data(DataSection(path=f"{folder},{corpus}"), tmp_path / "cache")


@pytest.mark.slow
def test_saved_dataset_dict_uses_its_validation_split(tmp_path):
    folder = _save_dataset(tmp_path / "dd", None, dict_splits={
        "train": ["train text one. " * 20, "train text two. " * 20],
        "validation": ["held out. " * 20]})
    data = load_data(DataSection(path=str(folder)), tmp_path / "cache")
    assert bytes(data.val).decode() == "held out. " * 20
    assert bytes(data.train).decode() == "train text one. " * 20 + "train text two. " * 20
    other = _save_dataset(tmp_path / "tt", None, dict_splits={"test": ["x " * 50]})
    with pytest.raises(ValueError, match="no 'train'"):
        load_data(DataSection(path=str(other)), tmp_path / "cache")


def test_cached_token_files_carry_sidecars(corpus, tmp_path):
    load_data(DataSection(path=str(corpus)), tmp_path / "cache")
    for path in (tmp_path / "cache").glob("tok-*.bin"):
        meta = json.loads(path.with_name(path.name + ".json").read_text())
        assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256
        assert meta["tokens"] == path.stat().st_size


def test_builtin_corpus_is_the_stdlib_bytes_split_by_file(tmp_path):
    data = load_data(DataSection(), tmp_path / "cache")
    root, rels = stdlib_files()
    val = [rel for rel in rels if is_validation(rel, 0.05)]
    assert "Python" in data.description and data.vocab_size == 256
    assert len(data.val) == sum((root / rel).stat().st_size for rel in val)
    first = next(rel for rel in val if (root / rel).stat().st_size)
    head = (root / first).read_bytes()
    assert bytes(data.val[:len(head)]) == head
    assert len(data.train) + len(data.val) == sum((root / r).stat().st_size for r in rels)


def test_saved_dataset_without_the_library_says_pip_install(tmp_path, monkeypatch):
    folder = tmp_path / "ds"                      # what save_to_disk leaves, as far as we look
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)     # `import datasets` fails
    with pytest.raises(ValueError, match="pip install datasets") as err:
        load_data(DataSection(path=str(folder)), tmp_path / "cache")
    assert str(folder) in str(err.value)
