"""Text corpora tokenized once into cached token files, streamed: never the whole corpus in memory.

A corpus is a sequence of documents, each assigned to train or validation: the text files of
`data.path` (a file, a directory read recursively in sorted order skipping hidden names, binary
files and `.bin` sidecars, or a comma-separated list), split BY FILE with
`is_validation(relative path)`; or the rows of a Hugging Face dataset saved with
`save_to_disk` (its `data.text_column`), split by row index the same way, or by its own
`validation` split when it is a DatasetDict with one.

`tokenize_corpus` reads each file in blocks of about BLOCK_BYTES (cut after a newline or before
a space between two non-blank bytes, where byte-level BPE pre-tokenizers split too), encodes
blocks of up to BATCH_BYTES of text in one batched call, appends the tokenizer's end-of-text
id after each document when it has one, and streams the ids into `<cache>/tok-<key>.train.bin`
and `.val.bin` (each with its `.json` sidecar). The key hashes the tokenizer's files, the split
settings and the corpus' relative paths and contents (xxh3, one read pass), so an edited
corpus or tokenizer is tokenized again. A file lock makes concurrent ranks tokenize once.
Memory stays at a few batches whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import xxhash

from moescale.atomic import is_temp_name
from moescale.dir_lock import hold_file
from moescale.train.token_files import TokenWriter, complete, dtype_for_vocab

CACHE_VERSION = 1
BLOCK_BYTES = 1 << 18       # text read from a file at a time
BATCH_BYTES = 1 << 20       # text per batched tokenizer call (bench data: 1 MiB batches of
                            # 256 KiB blocks ran 1.2x faster than 4 MiB of 1 MiB, at 0.6x the
                            # peak memory)
_BLANK = b" \t\r\n\x0b\x0c"

Document = tuple[bool, Iterable[bytes | str]]     # (validation?, its text blocks)


def is_validation(relpath: str, val_fraction: float) -> bool:
    """Deterministic split by file: a hash of the relative path, independent of the machine."""
    digest = hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < val_fraction


@dataclass
class Corpus:
    """Documents of one kind: `documents(val_fraction)` yields them in order; `files` are hashed
    (with their relative names) into the cache key; `kind` describes it."""

    kind: str
    files: list[tuple[str, Path]]
    documents: Callable[[float], Iterator[Document]]
    key_extra: list = field(default_factory=list)


def _last_between(buf: bytes, sep: bytes) -> int:
    """Index of the last `sep` byte with a non-blank byte on each side, or -1."""
    pos = len(buf) - 1
    while (pos := buf.rfind(sep, 1, pos)) > 0:
        if buf[pos - 1] not in _BLANK and buf[pos + 1] not in _BLANK:
            return pos
    return -1


def _cut(buf: bytes, final: bool) -> int:
    """Where to end a block: after the last newline between two non-blank bytes, else before
    the last space between two non-blank bytes (where byte-level BPE pre-tokenizers split
    anyway); 0 (read on) unless `final`; else before an incomplete UTF-8 character at the end."""
    if (pos := _last_between(buf, b"\n")) > 0:
        return pos + 1
    if (pos := _last_between(buf, b" ")) > 0:
        return pos
    if not final:
        return 0
    start = len(buf) - 1
    while start > 0 and len(buf) - start < 4 and buf[start] & 0xC0 == 0x80:
        start -= 1
    need = 4 if buf[start] >= 0xF0 else 3 if buf[start] >= 0xE0 else 2 if buf[start] >= 0xC0 else 1
    return start if start > 0 and len(buf) - start < need else len(buf)


def file_blocks(path: Path, block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """The file's bytes in blocks of about `block_bytes`, cut by `_cut` (a block grows to at
    most 8 x block_bytes while no cut is found)."""
    carry = b""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(block_bytes):
                buf = carry + chunk
                cut = _cut(buf, len(buf) >= 8 * block_bytes)
                carry = buf[cut:]
                if cut:
                    yield buf[:cut]
    except OSError as err:
        raise ValueError(f"data.path: cannot read {str(path)!r} ({err.strerror}); check its "
                         "permissions or leave it out") from None
    if carry:
        yield carry


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def list_sources(paths: list[Path], cache_dir: Path) -> tuple[list[tuple[str, Path]], list[Path]]:
    """(text files as (relative name, path), token .bin files) of the given paths; a folder's
    hidden names and anything under `cache_dir` (the token cache may live inside it) are
    left out."""
    files: list[tuple[str, Path]] = []
    bins: list[Path] = []
    cache = cache_dir.absolute()
    for path in paths:
        if path.is_dir():
            for sub in sorted(p for p in path.rglob("*") if p.is_file()):
                rel = sub.relative_to(path)
                if any(part.startswith(".") for part in rel.parts) or \
                        sub.absolute().is_relative_to(cache):
                    continue
                if sub.suffix == ".bin":
                    bins.append(sub)
                elif not (sub.name.endswith(".bin.json") and sub.with_suffix("").is_file()) \
                        and _is_text(sub):
                    files.append((str(rel), sub))
        elif path.suffix == ".bin":
            bins.append(path)
        else:
            files.append((path.name, path))
    return files, bins


def text_corpus(files: list[tuple[str, Path]], kind: str) -> Corpus:
    def documents(val_fraction: float) -> Iterator[Document]:
        for rel, path in files:
            yield is_validation(rel, val_fraction), file_blocks(path)
    return Corpus(kind, files, documents)


def dataset_corpus(path: Path, column: str) -> Corpus:
    """The rows of a dataset saved on disk; ValueError naming `pip install datasets` if the
    library is missing, or the column if it is not a text column."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.path {str(path)!r} is a Hugging Face dataset saved on disk; "
                         "reading it needs the datasets library: pip install datasets") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"data.path {str(path)!r} is a DatasetDict with splits "
                             f"{', '.join(loaded)} but no 'train'; save the split to train on "
                             "as 'train' (and optionally 'validation')")
        has_val = "validation" in loaded
        parts = [(loaded["train"], False if has_val else None)]
        parts += [(loaded["validation"], True)] if has_val else []
    else:
        parts = [(loaded, None)]
    for part, _ in parts:
        dtype = getattr(part.features.get(column), "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(f"data.text_column={column!r} is not a text column of the dataset "
                             f"{str(path)!r} (columns: {', '.join(part.column_names)}); give "
                             "--data.text_column NAME")

    def documents(val_fraction: float) -> Iterator[Document]:
        for part, forced in parts:
            row = 0
            for batch in part.select_columns([column]).iter(batch_size=1024):
                for text in batch[column]:
                    is_val = forced if forced is not None else is_validation(f"row {row}",
                                                                             val_fraction)
                    row += 1
                    if text:
                        yield is_val, (text,)
    files = sorted((str(p.relative_to(path)), p) for p in path.rglob("*") if p.is_file())
    kind = f"saved dataset, {sum(len(p) for p, _ in parts):,} rows"
    return Corpus(kind, files, documents, [column])


def content_key(files: list[tuple[str, Path]], extra: list) -> str:
    """xxh3 of `extra` (JSON) and every file's relative name, contents and size."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps([CACHE_VERSION, *extra]).encode())
    for rel, path in files:
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                digest.update(chunk)
        digest.update(b"\0%d\0" % path.stat().st_size)
    return digest.hexdigest()[:20]


@contextmanager
def build_lock(stem: Path) -> Iterator[None]:
    """Hold `<stem>.lock` exclusively (never through a symlink: dir_lock.hold_file): the first
    process builds the cached files, the others wait and then find them whole. The temp files
    of a killed builder of the same stem (`.<stem>.*.tmp`: nobody else writes them while the
    lock is held) are removed first."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    with hold_file(f"{stem}.lock"):
        prefix = f".{stem.name}."
        for name in os.listdir(stem.parent):
            if name.startswith(prefix) and is_temp_name(name):
                path = stem.parent / name
                if not stat.S_ISDIR(path.lstat().st_mode):
                    path.unlink(missing_ok=True)
        yield


def _encode_into(tokenizer, pending: list, eos: np.ndarray) -> None:
    blocks = [block for _, block in pending if block is not None]
    encoded = iter(tokenizer.encode_blocks(blocks))
    for writer, block in pending:
        writer.write(eos if block is None else next(encoded))
    pending.clear()


def tokenize_corpus(corpus: Corpus, tokenizer, cache_dir: Path, val_fraction: float
                    ) -> tuple[Path, Path]:
    """The train and validation token files of `corpus` under `cache_dir`, tokenized now unless
    a whole cached copy exists (another process holding the lock finishes first)."""
    key = content_key(corpus.files, [tokenizer.fingerprint, val_fraction, corpus.key_extra])
    stem = cache_dir / f"tok-{key}"
    train_path, val_path = Path(f"{stem}.train.bin"), Path(f"{stem}.val.bin")
    with build_lock(stem):
        if complete(train_path) and complete(val_path):
            return train_path, val_path
        dtype = dtype_for_vocab(tokenizer.vocab_size)
        meta = dict(tokenizer=tokenizer.path or "bytes", source=corpus.kind,
                    val_fraction=val_fraction)
        eos = np.array([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=np.int64)
        with TokenWriter(train_path, dtype, tokenizer.vocab_size, split="train", **meta) as tw, \
                TokenWriter(val_path, dtype, tokenizer.vocab_size, split="val", **meta) as vw:
            pending: list = []
            size = 0
            for is_val, blocks in corpus.documents(val_fraction):
                writer, any_text = (vw if is_val else tw), False
                for block in blocks:
                    pending.append((writer, block))
                    size += len(block)
                    any_text = True
                    if size >= BATCH_BYTES:
                        _encode_into(tokenizer, pending, eos)
                        size = 0
                if any_text and len(eos):
                    pending.append((writer, None))
            _encode_into(tokenizer, pending, eos)
    return train_path, val_path
