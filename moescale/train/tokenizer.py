"""Tokenizers of the training text: bytes (the default) or a local Hugging Face `tokenizers` file.

`load_tokenizer(path)` is the one entry point, for training (`data.tokenizer`) and for decoding
a run later (its config records the resolved path):

- `''`: `ByteTokenizer`, token id = byte value (vocabulary 256);
- a `tokenizer.json` file (any model the `tokenizers` library saves), or a directory holding one;
- GPT-2's byte-level BPE given as its two files: a directory holding `vocab.json` and
  `merges.txt` (or the path of that `vocab.json`), read with `ByteLevelBPETokenizer`.

Both kinds offer `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` (largest
id + 1, added tokens included), `eos_id` (the id of `<|endoftext|>`, `</s>`, `<|end_of_text|>`
or `<eos>` when the vocabulary has one, else None: appended after each document), `fingerprint`
(a hash of the files' contents, the token cache's key) and `encode_blocks`, the batched encoder
of the data pipeline (text blocks in, one numpy id array per block out). Bad paths raise
ValueError naming `data.tokenizer`. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
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


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("data.tokenizer needs the tokenizers library: pip install tokenizers"
                         ) from None
    return tokenizers


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | FileTokenizer:
    """The tokenizer at `path` ('' or None: bytes); ValueError naming data.tokenizer if the
    path holds neither a tokenizer.json nor vocab.json + merges.txt, or does not load."""
    if path is None or not str(path).strip():
        return ByteTokenizer()
    given = Path(str(path)).expanduser()
    if not given.exists():
        raise ValueError(f"data.tokenizer={str(path)!r} does not exist; give a tokenizer.json, "
                         "or a directory holding tokenizer.json or vocab.json + merges.txt")
    folder = given if given.is_dir() else given.parent
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
