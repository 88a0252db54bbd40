"""Expert state formats: how a store record holds an expert's master weights and Adam moments.

A run chooses per store (`OffloadConfig.master` / `.moments`):
- master `fp32` (the exact default) or `bf16`, updated with stochastic rounding (the fp32 result
  of AdamW plus 16 bits of noise, truncated: unbiased; the noise is a fixed seeded table read
  at an offset derived from (seed, layer, expert, step), so a resumed run rounds bitwise as the
  uninterrupted one);
- moments `fp32`, `bf16` (round to nearest) or `int8`: block-wise dynamic quantisation
  (Dettmers et al. 2021, arXiv 2110.02861; the codes and their tables: int8_codes.py).
The gradient accumulator stays fp32 (and out of the files between steps).

A record is four rows in the order MASTER, EXP_AVG, EXP_AVG_SQ, GRAD (records.py), each padded
to ROW_ALIGN bytes (direct I/O); `RecordGeometry` gives their offsets. fp32 state has exactly
the earlier layout (four rows of align_up(4 P) bytes), so its files and tests are unchanged.
An int8 moment row holds the codes of ceil(P / BLOCK) whole blocks, then their fp32 scales.

`StateCodec` decodes a record's rows into fp32 work buffers and encodes them back, CHUNK numbers
at a time so that a chunk's several passes stay in the cache (`moescale bench compact-optimizer`,
8.4M-parameter expert, bf16 master + int8 moments, one thread: 36.8 ms per AdamW step against
64.8 ms over whole rows before; 21.8 ms where the int8 step runs as one C loop: compact_adamw.py); it keeps its buffers between calls (one codec per thread that
steps experts: the host optimizer's workers).

Deliberately not here: where records live (store.py, disk_tier.py), the AdamW math
(compact_adamw.py), the C loops (codec_kernels.py).

Legend: P parameters of one expert, N numbers padded to whole blocks (N = nb * BLOCK).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moescale.offload import codec_kernels
from moescale.offload.direct_io import align_up
from moescale.offload.int8_codes import (BLOCK, TABLE_BITS, TABLE_MASK, nearest_table,
                                         pair_table)
from moescale.offload.records import POS_GRAD, POS_MASTER

MASTERS = ("fp32", "bf16")
MOMENTS = ("fp32", "bf16", "int8")
NOISE_NUMBERS = 1 << 22         # the stochastic-rounding table (int32; read at offsets)
_ITEMSIZE = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True, kw_only=True)
class StateFormat:
    """The formats of an expert's master weights and Adam moments in a store record."""

    master: str = "fp32"        # fp32 | bf16 (stochastic rounding)
    moments: str = "fp32"       # fp32 | bf16 | int8 (block-wise dynamic quantisation)
    seed: int = 0               # stochastic rounding of a bf16 master

    def __post_init__(self) -> None:
        if self.master not in MASTERS:
            raise ValueError(f"master={self.master!r} is unknown; use one of "
                             f"{', '.join(MASTERS)}")
        if self.moments not in MOMENTS:
            raise ValueError(f"moments={self.moments!r} is unknown; use one of "
                             f"{', '.join(MOMENTS)}")

    @property
    def exact(self) -> bool:
        """fp32 master and moments: the records of every earlier version."""
        return self.master == "fp32" and self.moments == "fp32"

    @property
    def name(self) -> str:
        return f"master={self.master},moments={self.moments}"

    def row_bytes(self, pos: int, numel: int) -> int:
        """Payload bytes of row `pos` for an expert of numel parameters (unpadded)."""
        if pos == POS_MASTER:
            return _ITEMSIZE[self.master] * numel
        if pos == POS_GRAD:
            return 4 * numel
        if self.moments == "int8":
            nb = -(-numel // BLOCK)
            return nb * BLOCK + 4 * nb
        return _ITEMSIZE[self.moments] * numel

    def state_bytes_per_param(self) -> float:
        """Bytes per parameter that persist between steps (master + two moments)."""
        moment = 1 + 4 / BLOCK if self.moments == "int8" else _ITEMSIZE[self.moments]
        return _ITEMSIZE[self.master] + 2 * moment


def parse_formats(text: str) -> list[StateFormat]:
    """'fp32+fp32,bf16+int8' -> StateFormats; ValueError naming a bad entry."""
    out = []
    for item in text.split(","):
        master, plus, moments = item.strip().partition("+")
        if not plus:
            raise ValueError(f"format {item!r} is not MASTER+MOMENTS (e.g. bf16+int8)")
        out.append(StateFormat(master=master, moments=moments))
    return out


class RecordGeometry:
    """Byte offsets of a record's rows (each padded to `align` bytes) for numel parameters."""

    def __init__(self, fmt: StateFormat, numel: int, align: int | None = None) -> None:
        self.fmt, self.numel = fmt, numel
        pad = align_up if align is None else (lambda n: -(-n // align) * align)
        self.sizes = [fmt.row_bytes(pos, numel) for pos in range(4)]
        self.strides = [pad(s) for s in self.sizes]
        self.offsets = [sum(self.strides[:pos]) for pos in range(5)]
        self.total = self.offsets[4]

    def span(self, first: int, count: int) -> tuple[int, int]:
        """(start, stop) bytes of `count` consecutive rows from position `first`."""
        return self.offsets[first], self.offsets[first + count]

    def row(self, record_u8: torch.Tensor, pos: int) -> torch.Tensor:
        """The payload of row `pos` (uint8) in a record buffer."""
        start = self.offsets[pos]
        return record_u8[start:start + self.sizes[pos]]

    def typed(self, record_u8: torch.Tensor, pos: int) -> torch.Tensor:
        """Row `pos` as the tensor the format keeps: fp32 / bf16 [P], or an int8 moment's raw
        uint8 row (codes and scales; decode it with StateCodec)."""
        raw = self.row(record_u8, pos)
        kind = (self.fmt.master if pos == POS_MASTER else
                "fp32" if pos == POS_GRAD else self.fmt.moments)
        if kind == "int8":
            return raw
        return raw.view(torch.float32 if kind == "fp32" else torch.bfloat16)


CHUNK = 1 << 18     # numbers per codec chunk: its fp32 work buffers (1 MiB each) stay in cache
assert CHUNK % BLOCK == 0 and NOISE_NUMBERS % CHUNK == 0, "chunks hold whole blocks and parts"


class StateCodec:
    """Decode rows of a StateFormat into fp32 buffers and encode them back (one thread).

    Every conversion runs chunk by chunk (CHUNK numbers, whole int8 blocks) through kept work
    buffers, so its several passes over a chunk hit the cache instead of memory. `chunks` hands
    an expert's state to the AdamW step one decoded chunk at a time; the whole-row methods
    (checkpoints, state access, tests) run the same kernels. `kernels`: convert with the
    one-pass C loops (codec_kernels.py; bitwise the torch ops) where a compiler built them
    (None), or with torch ops only (False)."""

    def __init__(self, fmt: StateFormat, chunk: int = CHUNK, kernels: bool | None = None
                 ) -> None:
        if chunk % BLOCK or NOISE_NUMBERS % chunk:
            raise ValueError(f"codec chunk {chunk} must be a multiple of {BLOCK} dividing "
                             f"{NOISE_NUMBERS}")
        self.fmt, self.chunk = fmt, chunk
        self.kernels = None if kernels is False or fmt.exact else codec_kernels.load()
        self._buf: dict[str, torch.Tensor] = {}
        self._noise: torch.Tensor | None = None

    def buffer(self, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
        """A kept work buffer of at least numel elements (the first numel of it)."""
        buf = self._buf.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buf[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    # ------------------------------------------------------------------ a whole expert
    def chunks(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               numel: int, where: tuple[int, ...]
               ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (lo, hi, master_C, exp_avg_C, exp_avg_sq_C): numbers lo..hi of the rows as
        fp32 (the rows themselves where they are fp32, else decoded work buffers), chunk by
        chunk; what the caller leaves in them is encoded back into the rows before the next
        chunk is decoded (a bf16 master by stochastic rounding keyed by where = (layer,
        expert, step)). Stop early and the rest of the rows is untouched."""
        for lo in range(0, numel, self.chunk):
            hi = min(numel, lo + self.chunk)
            master_C = self._master_in(master, lo, hi)
            exp_avg_C = self._moment_in(exp_avg, numel, lo, hi, True, "m.c")
            exp_avg_sq_C = self._moment_in(exp_avg_sq, numel, lo, hi, False, "v.c")
            yield lo, hi, master_C, exp_avg_C, exp_avg_sq_C
            self._master_out(master_C, master, lo, hi, where)
            self._moment_out(exp_avg_C, exp_avg, numel, lo, hi, True)
            self._moment_out(exp_avg_sq_C, exp_avg_sq, numel, lo, hi, False)

    # ------------------------------------------------------------------ whole rows
    def decode_master(self, row: torch.Tensor, numel: int, out_P: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The master as fp32 [P]: the row itself for fp32, else a copy into out_P / a buffer."""
        if self.fmt.master == "fp32" and out_P is None:
            return row
        out_P = self.buffer("master", numel) if out_P is None else out_P
        return out_P.copy_(row)

    def encode_master(self, master_P: torch.Tensor, row: torch.Tensor, where: tuple[int, ...]
                      ) -> None:
        """Write fp32 master_P into the row (fp32: a copy unless it is the row; bf16: stochastic
        rounding keyed by `where` = (layer, expert, step); master_P is overwritten)."""
        for lo in range(0, master_P.numel(), self.chunk):
            hi = min(master_P.numel(), lo + self.chunk)
            self._master_out(master_P[lo:hi], row, lo, hi, where)

    def decode_state(self, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, numel: int) -> tuple[torch.Tensor, ...]:
        """Fresh fp32 [P] copies of a record's master and moments (rows as the store keeps)."""
        out = [torch.empty(numel) for _ in range(3)]
        self.decode_master(master, numel, out[0])
        self.decode_moment(exp_avg, numel, True, "m", out[1])
        self.decode_moment(exp_avg_sq, numel, False, "v", out[2])
        return tuple(out)

    def encode_state(self, rows: tuple[torch.Tensor, ...], master_P: torch.Tensor,
                     exp_avg_P: torch.Tensor | None, exp_avg_sq_P: torch.Tensor | None,
                     numel: int) -> None:
        """Set a record's rows (master, exp_avg, exp_avg_sq) from fp32 [P] tensors (None: zero
        moments; a bf16 master rounds to nearest)."""
        rows[0].copy_(master_P.reshape(-1))
        for row, value, signed in ((rows[1], exp_avg_P, True), (rows[2], exp_avg_sq_P, False)):
            value = torch.zeros(numel) if value is None else \
                value.reshape(-1).to(torch.float32, copy=True)
            self.encode_moment(value, row, signed)

    def decode_moment(self, row: torch.Tensor, numel: int, signed: bool, slot: str,
                      out_P: torch.Tensor | None = None) -> torch.Tensor:
        """A moment as fp32 [P]: the row itself for fp32, else decoded into out_P / a buffer
        named slot."""
        if self.fmt.moments == "fp32" and out_P is None:
            return row
        out_P = self.buffer(slot, numel) if out_P is None else out_P
        if self.fmt.moments != "int8":
            return out_P.copy_(row)
        for lo in range(0, numel, self.chunk):
            hi = min(numel, lo + self.chunk)
            # whole blocks (all but a partial last one) of an 8-byte-aligned out: in place
            whole = (hi - lo) % BLOCK == 0 and out_P[lo:].data_ptr() % 8 == 0
            got = self._moment_in(row, numel, lo, hi, signed, "chunk",
                                  out_C=out_P[lo:hi] if whole else None)
            if not whole:
                out_P[lo:hi].copy_(got)
        return out_P

    def encode_moment(self, value_P: torch.Tensor, row: torch.Tensor, signed: bool) -> None:
        """Write fp32 value_P into a moment row (value_P may be used as scratch)."""
        if self.fmt.moments != "int8":
            if value_P.data_ptr() != row.data_ptr():
                row.copy_(value_P)
            return
        numel = value_P.numel()
        for lo in range(0, numel, self.chunk):
            hi = min(numel, lo + self.chunk)
            self._moment_out(value_P[lo:hi], row, numel, lo, hi, signed)

    # ------------------------------------------------------------------ one chunk
    def _master_in(self, row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if self.fmt.master == "fp32":
            return row[lo:hi]
        return self.buffer("master.c", self.chunk)[:hi - lo].copy_(row[lo:hi])

    def _master_out(self, master_C: torch.Tensor, row: torch.Tensor, lo: int, hi: int,
                    where: tuple[int, ...]) -> None:
        """fp32: copy unless master_C is the row; bf16: add the noise of numbers lo..hi (part
        lo // NOISE_NUMBERS of the expert, read from its hashed offset), truncate, store."""
        if self.fmt.master == "fp32":
            if master_C.data_ptr() != row[lo:].data_ptr():
                row[lo:hi].copy_(master_C)
            return
        noise_C = self.noise(where, lo, hi)
        if self.kernels is not None and row.dtype == torch.bfloat16 \
                and master_C.is_contiguous():
            self.kernels.encode_bf16_sr(master_C, noise_C, row[lo:], hi - lo)
            return
        bits_C = master_C.view(torch.int32)
        bits_C.add_(noise_C)
        bits_C.bitwise_and_(-65536)            # the low 16 bits: now exact in bf16
        row[lo:hi].copy_(master_C)

    def noise(self, where: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """int32 [hi - lo]: the rounding noise of numbers lo..hi (within one part of
        NOISE_NUMBERS) of the expert and step `where` = (layer, expert, step)."""
        part = lo // NOISE_NUMBERS
        assert (hi - 1) // NOISE_NUMBERS == part, "noise is read within one part"
        off = _mix(self.fmt.seed, *where, part) % NOISE_NUMBERS + lo - part * NOISE_NUMBERS
        return self._noise_table()[off:off + hi - lo]

    def _noise_table(self) -> torch.Tensor:
        """int32 [2 NOISE_NUMBERS]: uniform in [0, 65536), from the format's seed, twice."""
        if self._noise is None:
            gen = torch.Generator().manual_seed(_mix(self.fmt.seed, 0x5EED) & (2 ** 63 - 1))
            half = torch.randint(0, 65536, (NOISE_NUMBERS,), dtype=torch.int32, generator=gen)
            self._noise = torch.cat([half, half])
        return self._noise

    def int8_parts(self, row: torch.Tensor, numel: int, lo: int, hi: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (uint8 [blocks * BLOCK]) and scales (fp32 [blocks]) of numbers lo..hi."""
        nb, b_lo, b_hi = -(-numel // BLOCK), lo // BLOCK, -(-hi // BLOCK)
        codes = row[b_lo * BLOCK:b_hi * BLOCK]
        scale_n = row[nb * BLOCK:nb * BLOCK + 4 * nb].view(torch.float32)[b_lo:b_hi]
        return codes, scale_n

    def _moment_in(self, row: torch.Tensor, numel: int, lo: int, hi: int, signed: bool,
                   slot: str, out_C: torch.Tensor | None = None) -> torch.Tensor:
        """Numbers lo..hi as fp32: the fp32 row itself, else decoded into out_C (whole blocks)
        or the work buffer named slot."""
        kind = self.fmt.moments
        if kind == "fp32":
            return row[lo:hi]
        out_C = self.buffer(slot, self.chunk) if out_C is None else out_C
        if kind == "bf16":
            return out_C[:hi - lo].copy_(row[lo:hi])
        codes, scale_n = self.int8_parts(row, numel, lo, hi)
        if self.kernels is not None:
            self.kernels.decode_int8(codes, scale_n, out_C, hi - lo, signed)
            return out_C[:hi - lo]
        full_C = out_C[:codes.numel()]          # whole blocks (the last may be padding)
        idx = self.buffer("idx", self.chunk, torch.int32)[:codes.numel() // 2]
        idx.copy_(codes.view(torch.uint16))     # two codes per gather
        torch.index_select(pair_table(signed), 0, idx, out=full_C.view(torch.int64))
        full_C.view(-1, BLOCK).mul_(scale_n[:, None])
        return full_C[:hi - lo]

    def _moment_out(self, value_C: torch.Tensor, row: torch.Tensor, numel: int, lo: int,
                    hi: int, signed: bool) -> None:
        kind = self.fmt.moments
        if kind != "int8":
            if value_C.data_ptr() != row[lo:].data_ptr():
                row[lo:hi].copy_(value_C)
            return
        codes, scale_n = self.int8_parts(row, numel, lo, hi)
        if self.kernels is not None:
            assert value_C.is_contiguous() and value_C.dtype == torch.float32
            self.kernels.encode_int8(value_C, hi - lo, codes, scale_n, signed)
            return
        x_nB = value_C
        if codes.numel() != value_C.numel():   # pad the last block with zeros
            x_nB = self.buffer("pad", self.chunk)[:codes.numel()]
            x_nB[:hi - lo].copy_(value_C)
            x_nB[hi - lo:].zero_()
        x_nB = x_nB.view(-1, BLOCK)
        torch.amax(x_nB, 1, out=scale_n)
        if signed:          # |x|'s max from max and min: two reductions, no |x| pass
            low_n = torch.amin(x_nB, 1, out=self.buffer("low", scale_n.numel()))
            torch.maximum(scale_n, low_n.neg_(), out=scale_n)
            scale_n.add_(0.0)   # -0.0 (a block of zeros) -> +0.0, as |x|'s max would be
        denom = torch.where(scale_n > 0, scale_n, torch.ones((), dtype=torch.float32))
        y = self.buffer("y", self.chunk)[:codes.numel()]
        torch.div(x_nB, denom[:, None], out=y.view(-1, BLOCK))
        idx = self.buffer("idx", self.chunk, torch.int32)[:codes.numel()]
        torch.bitwise_right_shift(y.view(torch.int32), 32 - TABLE_BITS, out=idx)
        idx.bitwise_and_(TABLE_MASK)    # the top bits as an unsigned table index
        torch.index_select(nearest_table(signed), 0, idx, out=codes)


def _mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


# ---------------------------------------------------------------------------- index entries
def record_info(fmt: StateFormat, geo: RecordGeometry) -> dict:
    """What a checkpoint index records of a record file's format: fp32 state its row stride
    (as every earlier version wrote), compact state its formats and the bytes of its state rows."""
    if fmt.exact:
        return dict(stride=geo.strides[POS_MASTER])
    return dict(state=dict(master=fmt.master, moments=fmt.moments),
                state_bytes=geo.offsets[POS_GRAD])


def format_of(info: dict) -> StateFormat:
    """The StateFormat an index entry names (none: fp32); ValueError if it names an unknown one."""
    state = info.get("state")
    if state is None:
        return StateFormat()
    if not isinstance(state, dict):
        raise ValueError(f"state {state!r} is not a format")
    return StateFormat(master=state.get("master"), moments=state.get("moments"))
