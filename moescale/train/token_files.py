"""Token `.bin` files: a flat array of token ids and its `NAME.bin.json` sidecar.

The sidecar records what the bytes cannot: `{"dtype": "uint16", "vocab_size": 50257}` (plus,
for files moescale writes, the token count, the tokenizer and the source). Every token file
moescale creates gets one. A user's `.bin` (nanoGPT's `prepare.py` writes GPT-2 ids as uint16
with no sidecar) is read with the sidecar's dtype or an explicit `data.token_dtype`; with neither
it is refused, as are a dtype contradicting the sidecar, a size that is not a whole number of
tokens, and ids outside [0, vocab_size) (`scan_ids` reads the memory map in blocks).

`TokenWriter` streams id arrays into a token file, published atomically (moescale/atomic.py)
with its sidecar written last. This file knows nothing about text or tokenizers.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from moescale.atomic import atomic_path, atomic_write_json

SCAN_BLOCK = 1 << 24        # tokens per block when scanning a memory map for its id range
DTYPES = ("uint8", "uint16", "uint32", "int32")


def sidecar_path(bin_path: str | Path) -> Path:
    bin_path = Path(bin_path)
    return bin_path.with_name(bin_path.name + ".json")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids < vocab_size."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "uint32"


def read_sidecar(bin_path: Path) -> dict | None:
    """The sidecar of `bin_path` (None if there is none); ValueError if it is malformed."""
    side = sidecar_path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the sidecar {str(side)!r} of data.path {str(bin_path)!r} is not "
                         f"readable JSON ({err}); write it as "
                         '{"dtype": "uint16", "vocab_size": 50257}') from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or not (
            vocab is None or (isinstance(vocab, int) and vocab >= 2)):
        raise ValueError(f"the sidecar {str(side)!r} of data.path {str(bin_path)!r} needs "
                         f"\"dtype\" (one of {', '.join(DTYPES)}) and optionally \"vocab_size\" "
                         f"(an integer >= 2); it holds {json.dumps(meta)[:200]}")
    return meta


def write_sidecar(bin_path: Path, dtype: str, vocab_size: int | None, **extra) -> None:
    meta = {"dtype": dtype, "vocab_size": vocab_size, **extra}
    atomic_write_json(sidecar_path(bin_path), meta)


def bin_dtype(bin_path: Path, given: str) -> tuple[str, int | None]:
    """(dtype, the sidecar's vocab_size or None) of a token .bin; `given` is
    data.token_dtype ('' = from the sidecar)."""
    meta = read_sidecar(bin_path)
    side = str(sidecar_path(bin_path))
    if meta is None:
        if not given:
            raise ValueError(
                f"data.path {str(bin_path)!r} is a token .bin with no sidecar {side!r} recording "
                "its dtype; give --data.token_dtype (nanoGPT's GPT-2 .bin files are uint16; "
                "uint8 reads bytes), or write the sidecar: "
                '{"dtype": "uint16", "vocab_size": 50257}')
        return given, (256 if given == "uint8" else None)
    if given and given != meta["dtype"]:
        raise ValueError(f"data.token_dtype={given!r} contradicts the sidecar {side!r} (dtype "
                         f"{meta['dtype']!r}) of data.path {str(bin_path)!r}; leave "
                         "data.token_dtype '' to use the sidecar, or correct the sidecar")
    return meta["dtype"], meta.get("vocab_size")


def open_bin(bin_path: Path, dtype: str) -> np.ndarray:
    """The file as a read-only memory map (an empty array for an empty file); ValueError if its
    size is not a whole number of `dtype` tokens."""
    size, itemsize = bin_path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"data.path {str(bin_path)!r} has {size} bytes, not a whole number of "
                         f"{dtype} tokens ({itemsize} bytes each); check data.token_dtype or "
                         "the sidecar's dtype")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_path, dtype=dtype, mode="r")


def scan_ids(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) id of a non-empty array, read in blocks of SCAN_BLOCK tokens (a
    memory map is never copied whole)."""
    lo, hi = None, None
    for start in range(0, len(tokens), SCAN_BLOCK):
        block = tokens[start:start + SCAN_BLOCK]
        b_lo, b_hi = int(block.min()), int(block.max())
        lo = b_lo if lo is None else min(lo, b_lo)
        hi = b_hi if hi is None else max(hi, b_hi)
    return lo, hi


def copy_tokens(sources: list[np.ndarray], final: Path, dtype: str, vocab_size: int | None,
                **extra) -> None:
    """Concatenate token arrays into the token file `final` (with its sidecar), in blocks."""
    with TokenWriter(final, dtype, vocab_size, **extra) as out:
        for tokens in sources:
            for start in range(0, len(tokens), SCAN_BLOCK):
                out.write(tokens[start:start + SCAN_BLOCK])


class TokenWriter:
    """Appends id arrays to a token file; on a clean exit the file is published atomically and
    its sidecar written (holding the token count). An exception leaves nothing behind."""

    def __init__(self, final: Path, dtype: str, vocab_size: int | None, **extra) -> None:
        self.final, self.dtype, self.vocab_size, self.extra = final, dtype, vocab_size, extra
        self.tokens = 0

    def __enter__(self) -> "TokenWriter":
        self._stack = contextlib.ExitStack()
        tmp = self._stack.enter_context(atomic_path(self.final))
        self._file = self._stack.enter_context(open(tmp, "wb"))
        return self

    def write(self, ids: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.tokens += len(ids)

    def __exit__(self, *exc) -> None:
        self._file.flush()
        self._stack.__exit__(*exc)
        if exc[0] is None:
            write_sidecar(self.final, self.dtype, self.vocab_size, tokens=self.tokens,
                          **self.extra)


def complete(bin_path: Path) -> bool:
    """Whether a token file moescale wrote is whole: its sidecar exists and counts its size."""
    try:
        meta = read_sidecar(bin_path)
    except ValueError:
        return False
    return (meta is not None and bin_path.is_file() and isinstance(meta.get("tokens"), int)
            and bin_path.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize)
