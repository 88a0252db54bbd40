"""Training data: token streams from the built-in corpus, text, a saved dataset or token .bin files.

The built-in corpus is the source of the Python standard library installed on this machine
(`sysconfig`'s stdlib path, every `*.py` outside site-packages, in sorted relative-path order),
tokenized like any text folder (bytes by default): split into train and validation BY FILE
with a deterministic hash of the relative path, so no file straddles the split, and cached as
token files keyed by the files' contents, so a changed standard library is read again.

`data.path` may also name a text file, a directory (its text files, recursively, split by
file), a comma-separated list of them, a Hugging Face dataset saved on disk, or token `.bin`
files (corpus.py, token_files.py). Text is tokenized once by `data.tokenizer` (bytes when unset;
tokenizer.py) into cached token files that are memory-mapped, so no corpus is ever held in
memory. A `.bin` is read with the dtype of its sidecar or `data.token_dtype`, its ids checked
against the vocabulary; several are joined once in the cache; its last `val_fraction` is the
validation stream, as for a text corpus too small to split by file. The model's vocabulary is
`data.vocab_size`, or (0) the tokenizer's, the sidecar's, or 256 for bytes.

Validation data of their own: `data.val_path` (any kind data.path takes) is the whole
validation stream and data.path the whole training stream; a data.path directory holding
nanoGPT's `train.bin` and `val.bin` trains on train.bin only and validates on val.bin only
(uint16 without a sidecar, as nanoGPT's prepare.py writes them; its `meta.pkl` gives the
vocabulary size, and its character table becomes the run's tokenizer: `meta_tokenizer`).

`TokenBatches` draws random windows from a `numpy` generator seeded by the run's seed; its state
is plain JSON so checkpoints restore it exactly. Validation batches come from a fresh generator
every time, so successive validation losses are measured on the same windows.

This file keeps no global state.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moescale.train.config import DataSection
from moescale.train.corpus import (Corpus, build_lock, content_key, dataset_corpus,
                                   is_saved_dataset, list_sources, text_corpus, tokenize_corpus)
from moescale.train.token_files import (bin_dtype, complete, copy_tokens, open_bin, read_sidecar,
                                         scan_ids)
from moescale.train.tokenizer import (ByteTokenizer, CharTokenizer, FileTokenizer, load_tokenizer,
                                      read_meta)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class TokenData:
    """Train and validation token streams (memory-mapped where they come from a file)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    tokenizer: ByteTokenizer | FileTokenizer | CharTokenizer | None = ByteTokenizer()  # None: ids


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library root and its *.py files (relative, sorted, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py") and os.access(os.path.join(dirpath, name), os.R_OK):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return root, sorted(found)


def builtin_corpus() -> Corpus:
    """The standard library's source files, as a text corpus."""
    root, relpaths = stdlib_files()
    if not relpaths:
        raise ValueError(f"data.path='' (the built-in corpus) found no *.py files under the "
                         f"standard library {str(root)!r}; give a text file or directory "
                         "with --data.path")
    version = ".".join(map(str, sys.version_info[:3]))
    return text_corpus([(rel, root / rel) for rel in relpaths],
                       f"Python {version} standard library, {len(relpaths)} files")


def _tail_split(tokens: np.ndarray, val_fraction: float):
    num_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:-num_val], tokens[-num_val:]


def _model_vocab(cfg: DataSection, data_vocab: int | None, origin: str, top: int) -> int:
    """The model's vocabulary: data.vocab_size, or (0) the data's own; never below the data's."""
    if cfg.vocab_size == 0:
        if data_vocab is None:
            raise ValueError(f"data.path={cfg.path!r}: the vocabulary size of a token .bin "
                             f"without a sidecar is unknown (its ids reach {top}); give "
                             "--data.vocab_size (50257 for GPT-2 ids), or a sidecar with "
                             '"vocab_size"')
        return data_vocab
    if data_vocab is not None and cfg.vocab_size < data_vocab:
        raise ValueError(f"data.vocab_size={cfg.vocab_size} is smaller than the vocabulary of "
                         f"{origin} ({data_vocab}); leave data.vocab_size 0 to take it from the "
                         f"data, or give at least {data_vocab}")
    return cfg.vocab_size


def _split_or_tail(train: np.ndarray, val: np.ndarray, cfg: DataSection):
    if len(train) and len(val):
        return train, val
    tokens = train if len(train) else val   # too few files to split by file: hold out the tail
    if len(tokens) == 0:
        raise ValueError(f"data.path={cfg.path!r} holds no tokens (empty corpus); give "
                         "non-empty text files")
    return _tail_split(tokens, cfg.val_fraction)


def _join(arrays: list[np.ndarray], final: Path, dtype: str, vocab: int | None) -> np.ndarray:
    """Several token arrays as one memory-mapped file in the cache (joined once, in blocks)."""
    arrays = [a for a in arrays if len(a)]
    if len(arrays) == 1:
        return arrays[0]
    with build_lock(final):
        if not complete(final):
            copy_tokens(arrays, final, dtype, vocab)
    return open_bin(final, dtype)


def _from_text(cfg: DataSection, corpus: Corpus, tokenizer, cache: Path, whole: bool
               ) -> TokenData:
    train_path, val_path = tokenize_corpus(corpus, tokenizer, cache, cfg.val_fraction)
    dtype, _ = bin_dtype(train_path, "")
    train, val = open_bin(train_path, dtype), open_bin(val_path, dtype)
    if whole:        # all of it is one split (data.val_path gives the other)
        train = _join([train, val], train_path.with_name(
            train_path.name.replace(".train.bin", ".all.bin")), dtype, tokenizer.vocab_size)
        val = train[:0]
        if not len(train):
            raise ValueError(f"data.path={cfg.path!r} holds no tokens (empty corpus); give "
                             "non-empty text files")
    else:
        train, val = _split_or_tail(train, val, cfg)
    origin = f"data.tokenizer {tokenizer.path}" if tokenizer.path else "byte-level text"
    vocab = _model_vocab(cfg, tokenizer.vocab_size, origin, 0)
    desc = (f"{cfg.path or 'built-in corpus'} ({corpus.kind}; tokens: "
            f"{tokenizer.describe()}): {len(train):,} train / {len(val):,} validation tokens")
    return TokenData(train, val, vocab, desc, tokenizer)


def _from_bins(cfg: DataSection, bins: list[Path], tokenizer, cache: Path, whole: bool
               ) -> TokenData:
    found = [bin_dtype(path, cfg.token_dtype) for path in bins]
    if len({dtype for dtype, _ in found}) > 1:
        raise ValueError(f"data.path={cfg.path!r} joins .bin files of different dtypes "
                         f"({', '.join(sorted({d for d, _ in found}))}); give files of one dtype")
    dtype = found[0][0]
    arrays = [a for a in (open_bin(path, dtype) for path in bins) if len(a)]
    if not arrays:
        raise ValueError(f"data.path={cfg.path!r} holds no tokens (empty corpus); give "
                         "non-empty token files")
    known = [v for _, v in found if v is not None]
    data_vocab, origin = (max(known), "the .bin sidecar") if known else (None, "")
    if tokenizer is not None:
        if data_vocab is not None and data_vocab > tokenizer.vocab_size:
            raise ValueError(f"data.tokenizer={cfg.tokenizer!r} has {tokenizer.vocab_size} "
                             f"tokens but the sidecar of data.path={cfg.path!r} says "
                             f"vocab_size {data_vocab}; give the tokenizer these ids came from")
        data_vocab, origin = tokenizer.vocab_size, f"data.tokenizer {tokenizer.path}"
    files = [(str(i), path) for i, path in enumerate(bins)]
    tokens = _join(arrays, cache / f"bins-{content_key(files, [dtype])}.bin", dtype, data_vocab)
    low, top = scan_ids(tokens)
    if low < 0:
        raise ValueError(f"data.path={cfg.path!r} has token id {low} < 0 (as {dtype}); token "
                         "ids lie in [0, data.vocab_size): check data.token_dtype and the file")
    vocab = _model_vocab(cfg, data_vocab, origin, top)
    if top >= vocab:
        source = f"data.vocab_size={cfg.vocab_size}" if cfg.vocab_size else origin
        raise ValueError(f"data.path={cfg.path!r} has token id {top} >= the vocabulary size "
                         f"{vocab} ({source}); check data.token_dtype and the file, or raise "
                         "data.vocab_size")
    train, val = (tokens, tokens[:0]) if whole else _tail_split(tokens, cfg.val_fraction)
    if tokenizer is None and dtype == "uint8" and vocab == 256:
        tokenizer = ByteTokenizer()
    desc = (f"{cfg.path} (token .bin, {dtype}): {len(train):,} train / {len(val):,} "
            "validation tokens")
    return TokenData(train, val, vocab, desc, tokenizer)


def nanogpt_dir(path: str) -> Path | None:
    """The directory `data.path` names when it holds nanoGPT's train.bin and val.bin."""
    folder = Path(path.strip()).expanduser() if path.strip() and "," not in path else None
    if folder is not None and (folder / "train.bin").is_file() and (folder / "val.bin").is_file():
        return folder
    return None


def meta_tokenizer(cfg: DataSection) -> str | None:
    """nanoGPT's meta.pkl beside data.path's train.bin / val.bin when it maps characters
    (stoi): the run's tokenizer when data.tokenizer is unset; None otherwise."""
    folder = nanogpt_dir(cfg.path)
    if cfg.tokenizer or folder is None or not (folder / "meta.pkl").is_file():
        return None
    return str((folder / "meta.pkl").absolute()) \
        if isinstance(read_meta(folder / "meta.pkl").get("stoi"), dict) else None


def _source(cfg: DataSection, tokenizer, cache: Path, whole: bool) -> TokenData:
    """The tokens of data.path, split (or, `whole`, all in `train`)."""
    if not cfg.path:
        return _from_text(cfg, builtin_corpus(), tokenizer, cache, whole)
    paths = [Path(p.strip()).expanduser() for p in cfg.path.split(",") if p.strip()]
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path {str(path)!r} does not exist; give a text file, a "
                             "directory, a saved dataset or a token .bin (or '' for the "
                             "built-in corpus)")
    saved = [path for path in paths if is_saved_dataset(path)]
    if saved:
        if len(paths) > 1:
            raise ValueError(f"data.path={cfg.path!r} joins a saved dataset ({str(saved[0])!r}) "
                             "with other paths; give the dataset alone")
        return _from_text(cfg, dataset_corpus(saved[0], cfg.text_column), tokenizer, cache,
                          whole)
    files, bins = list_sources(paths, cache)
    if bins and files:
        raise ValueError(f"data.path={cfg.path!r} mixes token .bin files and text; give one kind")
    if bins:
        return _from_bins(cfg, bins, tokenizer if cfg.tokenizer else None, cache, whole)
    return _from_text(cfg, text_corpus(files, f"{len(files)} text files"), tokenizer, cache,
                      whole)


def load_data(cfg: DataSection, cache_dir_default: str | Path) -> TokenData:
    """Resolve `data.path` (and `data.tokenizer`, `data.val_path`) to train/validation token
    streams, memory-mapped; ValueError on bad input. Validation comes from data.val_path, or
    nanoGPT's val.bin when data.path is a directory holding train.bin and val.bin (train.bin
    alone is trained on; a meta.pkl there gives the vocabulary size), else it is held out of
    data.path."""
    cache = Path(cfg.cache_dir or cache_dir_default).expanduser()
    if cache.exists() and not cache.is_dir():
        raise ValueError(f"data.cache_dir={str(cache)!r} is a file, not a directory; give a "
                         "directory for the token cache (created if missing)")
    tokenizer = load_tokenizer(cfg.tokenizer)
    folder = nanogpt_dir(cfg.path)
    if folder is None and not cfg.val_path:
        return _source(cfg, tokenizer, cache, whole=False)
    train_cfg = cfg
    if folder is not None:
        meta = read_meta(folder / "meta.pkl") if (folder / "meta.pkl").is_file() else {}
        nano_dtype = "" if cfg.token_dtype or read_sidecar(folder / "train.bin") else "uint16"
        train_cfg = dataclasses.replace(cfg, path=str(folder / "train.bin"),
                                        token_dtype=cfg.token_dtype or nano_dtype,
                                        vocab_size=cfg.vocab_size or meta.get("vocab_size", 0))
    val_cfg = dataclasses.replace(train_cfg, path=cfg.val_path or str(folder / "val.bin"))
    train = _source(train_cfg, tokenizer, cache, whole=True)
    val = _source(val_cfg, tokenizer, cache, whole=True)
    kind = train.tokenizer.describe() if train.tokenizer is not None else "token ids"
    desc = (f"{train_cfg.path}: {len(train.train):,} train tokens; {val_cfg.path}: "
            f"{len(val.train):,} validation tokens (tokens: {kind})")
    return TokenData(train.train, val.train, max(train.vocab_size, val.vocab_size), desc,
                     train.tokenizer)


class TokenBatches:
    """Random (input, target) windows of `seq_len` tokens from a seeded numpy generator."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 split: str) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"the {split} stream has {len(tokens)} tokens, fewer than "
                             f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len or give "
                             "more text")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: idx_BS and targets_BS (int64)."""
        S = self.seq_len
        starts_B = self.rng.integers(0, len(self.tokens) - S, size=self.batch_size)
        window_BS = np.stack([np.asarray(self.tokens[s:s + S + 1], dtype=np.int64)
                              for s in starts_B])
        window_BS = torch.from_numpy(window_BS)
        return window_BS[:, :-1], window_BS[:, 1:]

    def state(self) -> dict:
        """JSON-serialisable generator state."""
        return self.rng.bit_generator.state

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state

    def fixed(self, num_batches: int):
        """`num_batches` batches from a fresh generator (the same windows on every call)."""
        rng = np.random.Generator(np.random.PCG64(self.seed))
        saved, self.rng = self.rng, rng
        try:
            return [self.next() for _ in range(num_batches)]
        finally:
            self.rng = saved
