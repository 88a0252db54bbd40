"""Safetensors files written one tensor at a time and read back one tensor at a time.

`write_tensors(path, specs)` writes the safetensors format (an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the tensors'
bytes back to back) from `TensorSpec(name, shape, produce)` entries: each `produce()` is
called only when its tensor's turn comes, so a file of many GB is written while holding one
tensor at a time. It returns the xxh3-64 sum (hex) of every tensor's bytes, and fsyncs.

`TensorFile(path)` parses the header and reads single tensors with `os.preadv` straight into
a caller's tensor (`read_into`) or sums them in 8 MiB pieces through one reused buffer
(`digest`). Nothing maps the file, so a read charges the process only the destination tensor
(a mapping's touched pages count in its resident set until unmapped). The files are ordinary
safetensors files: `safetensors.safe_open(path, "pt")` reads them too.

Not here: which tensors a file holds or where they go (save.py, load.py). fp32 only: the
expert state is fp32 wherever it lives.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import xxhash

PIECE_BYTES = 8 << 20     # digest() reads this much at a time
_MAX_HEADER = 256 << 20   # a header longer than this is not ours (corrupt length field)


class TensorFileError(OSError):
    """A tensor file that cannot be parsed or read (truncated, not safetensors, wrong dtype)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: `produce()` returns a CPU tensor of `shape` (cast to fp32)."""

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def write_tensors(path: str, specs: Sequence[TensorSpec],
                  metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write `specs` as one safetensors file at `path` (fsynced); returns name -> xxh3-64 hex.
    The caller publishes the file atomically (it writes into a temporary directory)."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"tensor name {spec.name!r} appears twice in one file")
        nbytes = 4 * math.prod(spec.shape)
        header[spec.name] = dict(dtype="F32", shape=list(spec.shape),
                                 data_offsets=[offset, offset + nbytes])
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)      # the data starts 8-byte aligned
    sums = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for spec in specs:
            t = spec.produce().detach()
            if tuple(t.shape) != tuple(spec.shape):
                raise ValueError(f"tensor {spec.name!r} has shape {tuple(t.shape)}, announced "
                                 f"{tuple(spec.shape)}")
            t = t.to("cpu", torch.float32)
            data = _bytes_of(t)
            f.write(data)
            sums[spec.name] = xxhash.xxh3_64_hexdigest(data)
            del t, data
        f.flush()
        os.fsync(f.fileno())
        try:   # written once, read at a resume: do not keep it in the page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
    return sums


class TensorFile:
    """One safetensors file opened for single-tensor reads (no mapping). Close it, or use
    `with`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.tensors = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> dict[str, tuple[tuple[int, ...], int, int]]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise TensorFileError(f"{self.path!r} is truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise TensorFileError(f"{self.path!r} is not a safetensors file or is truncated "
                                  f"(header length {length}, file size {size})")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (ValueError, UnicodeDecodeError) as err:
            raise TensorFileError(f"{self.path!r} has an unreadable header ({err})") from err
        start, out = 8 + length, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(x) for x in info["shape"])
                dtype = info["dtype"]
            except (KeyError, TypeError, ValueError) as err:
                raise TensorFileError(f"{self.path!r}: header entry {name!r} is malformed "
                                      f"({err})") from err
            if dtype != "F32" or end - begin != 4 * math.prod(shape) or start + end > size:
                raise TensorFileError(f"{self.path!r}: tensor {name!r} ({dtype} {shape}, bytes "
                                      f"{begin}..{end}) is not fp32 or lies past the end of "
                                      f"the file ({size} bytes); the file is truncated or "
                                      "corrupt")
            out[name] = (shape, start + begin, end - begin)
        return out

    def _entry(self, name: str) -> tuple[tuple[int, ...], int, int]:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorFileError(f"{self.path!r} lacks tensor {name!r}") from None

    def _pread(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n == 0:
                raise TensorFileError(f"{self.path!r} ends early (truncated)")
            got += n

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (any device or dtype with the tensor's shape) with tensor `name`; reads
        straight into it when it is a contiguous fp32 CPU tensor."""
        shape, offset, nbytes = self._entry(name)
        if tuple(out.shape) != shape:
            raise TensorFileError(f"{self.path!r}: tensor {name!r} has shape {shape}, the "
                                  f"destination {tuple(out.shape)}")
        direct = out.device.type == "cpu" and out.dtype == torch.float32 and \
            out.is_contiguous()
        buf = out if direct else torch.empty(shape, dtype=torch.float32)
        if nbytes:
            self._pread(_bytes_of(buf), offset)
        if not direct:
            with torch.no_grad():
                out.copy_(buf)
        return out

    def read(self, name: str) -> torch.Tensor:
        """A new CPU fp32 tensor holding `name`."""
        return self.read_into(name, torch.empty(self._entry(name)[0], dtype=torch.float32))

    def digest(self, name: str, scratch: bytearray | None = None) -> str:
        """xxh3-64 hex of tensor `name`'s bytes, read in pieces (`scratch`: a reused buffer)."""
        _, offset, nbytes = self._entry(name)
        scratch = scratch if scratch is not None else bytearray(min(nbytes, PIECE_BYTES) or 1)
        h, done = xxhash.xxh3_64(), 0
        while done < nbytes:
            n = min(len(scratch), nbytes - done)
            view = memoryview(scratch)[:n]
            self._pread(view, offset + done)
            h.update(view)
            done += n
        return h.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
