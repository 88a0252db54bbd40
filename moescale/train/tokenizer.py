"""Tokenizers of the training text: bytes (the default) or a local Hugging Face `tokenizers` file.

`load_tokenizer(path)` is the one entry point, for training (`data.tokenizer`) and for decoding
a run later (its config records the resolved path):

- `''`: `ByteTokenizer`, token id = byte value (vocabulary 256);
- a `tokenizer.json` file (any model the `tokenizers` library saves), or a directory holding one;
- GPT-2's byte-level BPE given as its two files: a directory holding `vocab.json` and
  `merges.txt` (or the path of that `vocab.json`), read with `ByteLevelBPETokenizer`;
- nanoGPT's character-level `meta.pkl` (stoi / itos, read without unpickling any code):
  `CharTokenizer`, one id per character.

Both kinds offer `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` (largest
id + 1, added tokens included), `eos_id` (the id of `<|endoftext|>`, `</s>`, `<|end_of_text|>`
or `<eos>` when the vocabulary has one, else None: appended after each document), `fingerprint`
(a hash of the files' contents, the token cache's key) and `encode_blocks`, the batched encoder
of the data pipeline (text blocks in, one numpy id array per block out). Bad paths raise
ValueError naming `data.tokenizer`. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: the default vocabulary of 256."""

    vocab_size = 256
    eos_id = None
    fingerprint = "bytes"
    path = ""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_blocks(self, blocks: list[bytes | str]) -> list[np.ndarray]:
        """Raw bytes stay as they are (no decoding); text is encoded as UTF-8."""
        return [np.frombuffer(b if isinstance(b, bytes) else b.encode("utf-8"), dtype=np.uint8)
                for b in blocks]

    def describe(self) -> str:
        return "bytes (vocabulary 256)"


class FileTokenizer:
    """A `tokenizers.Tokenizer` loaded from local files."""

    def __init__(self, tokenizer, path: Path, files: list[Path]) -> None:
        self.tokenizer = tokenizer
        self.path = str(path)
        self.files = list(files)
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
        self.fingerprint = digest.hexdigest()[:16]
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_blocks(self, blocks: list[bytes | str]) -> list[np.ndarray]:
        """Bytes are decoded as UTF-8 (invalid sequences become U+FFFD), then batch-encoded."""
        texts = [b.decode("utf-8", errors="replace") if isinstance(b, bytes) else b
                 for b in blocks]
        encodings = self._encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def describe(self) -> str:
        return f"{self.path} (vocabulary {self.vocab_size:,})"

    def tokenizers_object(self):
        """The `tokenizers.Tokenizer` itself (an export builds transformers' tokenizer on it)."""
        return self.tokenizer


class _MetaUnpickler(pickle.Unpickler):
    """Reads nanoGPT's meta.pkl (dicts of str and int) without running any code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain dicts, "
                                     "strings and integers are read")


def read_meta(path: Path) -> dict:
    """nanoGPT's meta.pkl ({'vocab_size', 'stoi', 'itos'}); ValueError if it is not one."""
    try:
        with open(path, "rb") as f:
            meta = _MetaUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as err:
        raise ValueError(f"{str(path)!r} does not read as nanoGPT's meta.pkl ({err}); give the "
                         "meta.pkl its prepare.py wrote, or remove it") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"{str(path)!r} holds no integer vocab_size >= 2; give the meta.pkl "
                         "nanoGPT's prepare.py wrote, or remove it")
    return meta


class CharTokenizer:
    """nanoGPT's character-level vocabulary (meta.pkl's stoi / itos): one id per character."""

    eos_id = None

    def __init__(self, path: Path, meta: dict) -> None:
        self.path, self.files = str(path), [path]
        self.stoi = {str(k): int(v) for k, v in meta["stoi"].items()}
        self.itos = {v: k for k, v in self.stoi.items()}
        self.vocab_size = max(int(meta["vocab_size"]), max(self.itos) + 1)
        self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise ValueError(f"the text holds characters outside the meta.pkl vocabulary "
                             f"{self.path!r}: {''.join(unknown[:10])!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos.get(int(i), "") for i in ids)

    def encode_blocks(self, blocks: list[bytes | str]) -> list[np.ndarray]:
        texts = [b.decode("utf-8", errors="replace") if isinstance(b, bytes) else b
                 for b in blocks]
        return [np.asarray(self.encode(t), dtype=np.uint32) for t in texts]

    def describe(self) -> str:
        return f"{self.path} (characters, vocabulary {self.vocab_size:,})"

    def tokenizers_object(self):
        """A `tokenizers.Tokenizer` with one token per character, ids as in meta.pkl."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel(vocab=self.stoi, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return tok


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("data.tokenizer needs the tokenizers library: pip install tokenizers"
                         ) from None
    return tokenizers


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | FileTokenizer | CharTokenizer:
    """The tokenizer at `path` ('' or None: bytes); ValueError naming data.tokenizer if the
    path holds neither a tokenizer.json nor vocab.json + merges.txt, or does not load."""
    if path is None or not str(path).strip():
        return ByteTokenizer()
    given = Path(str(path)).expanduser()
    if not given.exists():
        raise ValueError(f"data.tokenizer={str(path)!r} does not exist; give a tokenizer.json, "
                         "or a directory holding tokenizer.json or vocab.json + merges.txt")
    folder = given if given.is_dir() else given.parent
    if given.is_file() and given.suffix == ".pkl":
        meta = read_meta(given)
        if not isinstance(meta.get("stoi"), dict):
            raise ValueError(f"data.tokenizer={str(path)!r} has no stoi table (a meta.pkl of "
                             "GPT-2 ids); give the tokenizer these ids came from")
        return CharTokenizer(given, meta)
    if given.is_file() and given.name != "vocab.json":
        json_file = given
    elif given.is_dir() and (given / "tokenizer.json").is_file():
        json_file = given / "tokenizer.json"
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        json_file = None
    else:
        raise ValueError(f"data.tokenizer={str(path)!r} holds no tokenizer.json and no "
                         "vocab.json + merges.txt pair; give the tokenizer.json file or the "
                         "directory of a byte-level BPE's vocab.json and merges.txt")
    tokenizers = _import_tokenizers()
    try:
        if json_file is not None:
            return FileTokenizer(tokenizers.Tokenizer.from_file(str(json_file)), json_file,
                                 [json_file])
        vocab, merges = folder / "vocab.json", folder / "merges.txt"
        bpe = tokenizers.ByteLevelBPETokenizer(str(vocab), str(merges))
        return FileTokenizer(tokenizers.Tokenizer.from_str(bpe.to_str()), folder,
                             [vocab, merges])
    except Exception as err:    # the library raises plain Exception for unreadable files
        raise ValueError(f"data.tokenizer={str(path)!r} does not load as a tokenizer "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                         "give a tokenizer.json saved by the tokenizers library, or GPT-2 style "
                         "vocab.json + merges.txt") from None


RUN_COPY = "tokenizer"      # RUN_DIR/tokenizer/: the run's copy of its tokenizer's files


def keep_copy(tokenizer, run_dir: str | Path) -> None:
    """Copy a file-based tokenizer's files into RUN_DIR/tokenizer/ (bytes need none), so the
    run decodes and resumes after the original is moved or deleted (`run_tokenizer_path`)."""
    from moescale.atomic import atomic_write_bytes

    for file in getattr(tokenizer, "files", None) or []:
        atomic_write_bytes(Path(run_dir) / RUN_COPY / file.name, Path(file).read_bytes())


def run_tokenizer_path(path: str, run_dir: str | Path | None) -> str:
    """The tokenizer a run reads: `path` (its data.tokenizer) while it exists, else the run's
    copy in RUN_DIR/tokenizer/ when there is one; '' stays '' (bytes)."""
    if not path or Path(path).exists() or run_dir is None:
        return path
    folder = Path(run_dir) / RUN_COPY
    if (folder / Path(path).name).is_file():
        return str(folder / Path(path).name)
    return str(folder) if folder.is_dir() else path

