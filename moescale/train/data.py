"""Training data: byte-level token streams from the built-in corpus, text files or a token .bin.

The built-in corpus is the source of the Python standard library installed on this machine
(`sysconfig`'s stdlib path, every `*.py` outside site-packages, in sorted relative-path order),
read as bytes (tokens 0..255). Files are split into train and validation BY FILE with a
deterministic hash of the relative path, so no file straddles the split; the two streams are
cached as `.bin` token files (plus a JSON description) in the cache directory, keyed by the
file list, and rebuilt when the standard library changes.

`data.path` may also name a text file, a directory (its text files, recursively, split by
file), a comma-separated list of them, or a token `.bin` (a flat array of `data.token_dtype`;
its last `val_fraction` is the validation stream). A single text file is split the same way.

`TokenBatches` draws random windows from a `numpy` generator seeded by the run's seed; its state
is plain JSON so checkpoints restore it exactly. Validation batches come from a fresh generator
every time, so successive validation losses are measured on the same windows.

This file does not tokenize beyond bytes and keeps no global state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moescale.atomic import atomic_write_bytes
from moescale.train.config import DataSection

CORPUS_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class TokenData:
    """Train and validation token streams (memory-mapped where they come from a file)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library root and its *.py files (relative, sorted, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return root, sorted(found)


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Deterministic split by file: a hash of the relative path, independent of the machine."""
    digest = hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < val_fraction


def _read_files(root: Path, relpaths: list[str], val_fraction: float):
    train, val = [], []
    for rel in relpaths:
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        (val if is_validation(rel, val_fraction) else train).append(data)
    return b"".join(train), b"".join(val)


def builtin_corpus(cache_dir: str | Path, val_fraction: float) -> TokenData:
    """The standard library's source as byte tokens, built once and cached."""
    root, relpaths = stdlib_files()
    if not relpaths:
        raise ValueError(f"data.path='' (the built-in corpus) found no *.py files under the "
                         f"standard library {str(root)!r}; give a text file or directory "
                         "with --data.path")
    key_src = json.dumps([CORPUS_VERSION, str(root), val_fraction, relpaths,
                          [os.path.getsize(root / r) for r in relpaths]])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / f"stdlib-{key}.json"
    train_path, val_path = cache / f"stdlib-{key}.train.bin", cache / f"stdlib-{key}.val.bin"
    if not (meta_path.is_file() and train_path.is_file() and val_path.is_file()):
        train, val = _read_files(root, relpaths, val_fraction)
        atomic_write_bytes(train_path, train)
        atomic_write_bytes(val_path, val)
        meta = {"root": str(root), "files": len(relpaths), "train_tokens": len(train),
                "val_tokens": len(val), "val_fraction": val_fraction}
        atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    meta = json.loads(meta_path.read_text())
    train_arr = np.memmap(train_path, dtype=np.uint8, mode="r")
    val_arr = np.memmap(val_path, dtype=np.uint8, mode="r")
    desc = (f"Python {'.'.join(map(str, __import__('sys').version_info[:3]))} standard library: "
            f"{meta['files']} files, {len(train_arr):,} train / {len(val_arr):,} validation "
            "byte tokens")
    return TokenData(train_arr, val_arr, 256, desc)


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _text_sources(paths: list[Path]) -> tuple[list[tuple[str, Path]], list[Path]]:
    files: list[tuple[str, Path]] = []
    bins: list[Path] = []
    for path in paths:
        if path.is_dir():
            for sub in sorted(p for p in path.rglob("*") if p.is_file()):
                if sub.suffix != ".bin" and _is_text(sub):
                    files.append((str(sub.relative_to(path)), sub))
        elif path.suffix == ".bin":
            bins.append(path)
        else:
            files.append((path.name, path))
    return files, bins


def _tail_split(tokens: np.ndarray, val_fraction: float):
    num_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:-num_val], tokens[-num_val:]


def load_data(cfg: DataSection, cache_dir_default: str | Path) -> TokenData:
    """Resolve `data.path` to train/validation token streams; ValueError on bad input."""
    if not cfg.path:
        return builtin_corpus(cfg.cache_dir or cache_dir_default, cfg.val_fraction)
    paths = [Path(p.strip()).expanduser() for p in cfg.path.split(",") if p.strip()]
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path {str(path)!r} does not exist; give a text file, a "
                             "directory or a token .bin (or '' for the built-in corpus)")
    files, bins = _text_sources(paths)
    if bins and files:
        raise ValueError(f"data.path={cfg.path!r} mixes token .bin files and text; give one kind")
    if bins:
        dtype = np.dtype(cfg.token_dtype)
        arrays = []
        for path in bins:
            if path.stat().st_size % dtype.itemsize:
                raise ValueError(f"data.path {str(path)!r} has {path.stat().st_size} bytes, not "
                                 f"a whole number of {cfg.token_dtype} tokens; check "
                                 "data.token_dtype")
            if path.stat().st_size:
                arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        tokens = np.concatenate(arrays) if len(arrays) > 1 else (arrays[0] if arrays else
                                                                  np.zeros(0, dtype))
        train, val = _tail_split(tokens, cfg.val_fraction) if len(tokens) else (tokens, tokens)
        kind = "token .bin"
    else:
        by_file = [(rel, p.read_bytes()) for rel, p in files]
        by_file = [(rel, data) for rel, data in by_file if data]
        val_b = b"".join(d for rel, d in by_file if is_validation(rel, cfg.val_fraction))
        train_b = b"".join(d for rel, d in by_file if not is_validation(rel, cfg.val_fraction))
        if val_b and train_b:
            train = np.frombuffer(train_b, dtype=np.uint8)
            val = np.frombuffer(val_b, dtype=np.uint8)
        else:  # too few files to split by file: hold out the tail instead
            tokens = np.frombuffer(train_b + val_b, dtype=np.uint8)
            train, val = _tail_split(tokens, cfg.val_fraction) if len(tokens) else (tokens,
                                                                                    tokens)
        kind = f"{len(by_file)} text files"
    if len(train) == 0:
        raise ValueError(f"data.path={cfg.path!r} holds no tokens (empty corpus); give "
                         "non-empty text files")
    vocab = 256 if not bins else cfg.vocab_size
    low = int(min(train.min(), val.min() if len(val) else 0))
    if low < 0:
        raise ValueError(f"data.path={cfg.path!r} has token id {low} < 0 (as "
                         f"data.token_dtype={cfg.token_dtype!r}); token ids lie in [0, "
                         "data.vocab_size): check data.token_dtype and the file")
    top = int(max(train.max(), val.max() if len(val) else 0))
    if top >= vocab:
        raise ValueError(f"data.path={cfg.path!r} has token id {top} >= data.vocab_size="
                         f"{vocab}; raise data.vocab_size")
    desc = f"{cfg.path} ({kind}): {len(train):,} train / {len(val):,} validation tokens"
    return TokenData(train, val, vocab, desc)


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
