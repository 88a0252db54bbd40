"""Expert state formats: how a store record holds an expert's master weights and Adam moments.

A run chooses per store (`OffloadConfig.master` / `.moments`):
- master `fp32` (the exact default) or `bf16`, updated with stochastic rounding (the fp32 result
  of AdamW plus 16 bits of noise, truncated: unbiased; the noise is a fixed seeded table read
  at an offset derived from (seed, layer, expert, step), so a resumed run rounds bitwise as the
  uninterrupted one);
- moments `fp32`, `bf16` (round to nearest) or `int8`: block-wise dynamic quantisation
  (Dettmers et al. 2021, arXiv 2110.02861): each block of BLOCK numbers is divided by its
  absolute maximum (kept as an fp32 scale) and mapped to the nearest of 256 codes of a dynamic
  tree map (signed for exp_avg, unsigned for exp_avg_sq: decades 1e-6..1 with more linear
  fraction points in the upper decades). "Nearest" is taken of the centre of the fp32 numbers
  that share the normalised value's top 20 bits (sign, exponent, 11 mantissa bits), through a
  2^20-entry table indexed by those bits: a shift and one gather per number instead of a search
  (the codes are bf16 numbers, so dequantise -> quantise is the identity, bitwise). The gradient accumulator stays fp32 (and out of the files between steps).

A record is four rows in the order MASTER, EXP_AVG, EXP_AVG_SQ, GRAD (records.py), each padded
to ROW_ALIGN bytes (direct I/O); `RecordGeometry` gives their offsets. fp32 state has exactly
the earlier layout (four rows of align_up(4 P) bytes), so its files and tests are unchanged.
An int8 moment row holds the codes of ceil(P / BLOCK) whole blocks, then their fp32 scales.

`StateCodec` decodes a record's rows into fp32 work buffers and encodes them back; it keeps its
buffers between calls (one per thread that steps experts: the host optimizer's worker).

Deliberately not here: where records live (store.py, disk_tier.py), the AdamW math
(optimizer.py: torch's own AdamW on the decoded fp32 tensors).

Legend: P parameters of one expert, N numbers padded to whole blocks (N = nb * BLOCK).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from moescale.offload.direct_io import align_up
from moescale.offload.records import POS_GRAD, POS_MASTER

MASTERS = ("fp32", "bf16")
MOMENTS = ("fp32", "bf16", "int8")
BLOCK = 256                     # numbers per int8 quantisation block (one fp32 scale each)
NOISE_NUMBERS = 1 << 22         # the stochastic-rounding table (int32; read at offsets)
TABLE_BITS = 20                 # int8 codes are looked up by an fp32 number's top 20 bits (a
TABLE_MASK = (1 << TABLE_BITS) - 1   # 1 MiB table: buckets of 2^-11 relative, finer than the
                                     # codes' spacing, so dequantise -> quantise is exact)
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


# ---------------------------------------------------------------------------- int8 codes
@lru_cache(maxsize=2)
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 codes (ascending fp32, each a bf16 number) of the dynamic tree map on [-1, 1]
    (signed) or [0, 1]: for decade d = 0..6, the midpoints of 2^d (signed) or 2^(d+1) equal
    steps of [0.1, 1] scaled by 10^(d-6) (127 or 254 numbers), and 0 and 1; signed adds -1 and
    the negatives of all but the smallest (so both ends are exact: a block's absmax, of either
    sign, decodes to itself and a dequantised block quantises to the same codes and scale)."""
    values = []
    for d in range(7):
        n = 2 ** d if signed else 2 ** (d + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        values += ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (d - 6)).tolist()
    values += [0.0, 1.0] + ([-v for v in values[1:]] + [-1.0] if signed else [])
    code = torch.tensor(sorted(values), dtype=torch.float64).to(torch.bfloat16).float()
    assert code.numel() == 256 and bool((code[1:] > code[:-1]).all()), "codes must be distinct"
    return code


def _bucket_centres() -> torch.Tensor:
    """float64 [2^TABLE_BITS]: for each value of an fp32 number's top TABLE_BITS bits (as an
    unsigned index), the centre of the fp32 numbers that share them (clamped to [-1, 1]; NaN
    patterns give 0)."""
    low = 32 - TABLE_BITS
    top = torch.arange(1 << TABLE_BITS, dtype=torch.int64) << low
    lo = (top - (1 << 32) * (top >= 1 << 31)).to(torch.int32).view(torch.float32).double()
    top = top | ((1 << low) - 1)
    hi = (top - (1 << 32) * (top >= 1 << 31)).to(torch.int32).view(torch.float32).double()
    centre = ((lo + hi) / 2).clamp(-1.0, 1.0)
    return torch.where(centre.isnan(), torch.zeros((), dtype=torch.float64), centre)


@lru_cache(maxsize=2)
def nearest_table(signed: bool) -> torch.Tensor:
    """uint8 [2^TABLE_BITS]: for every value of an fp32 number's top TABLE_BITS bits, the index
    of the code nearest the centre of the numbers sharing them (ties to the lower code)."""
    code = dynamic_map(signed).double()
    mid = (code[1:] + code[:-1]) / 2
    return torch.bucketize(_bucket_centres(), mid, right=False).to(torch.uint8)


def quantize_reference(x_N: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 quantiser by its definition (slow, for tests): per block of BLOCK numbers the
    absmax scale, then for each number's normalised value (fp32 division) the code nearest
    (by distance, ties to the lower) the centre of the fp32 numbers sharing its top TABLE_BITS
    bits."""
    x_nB = x_N.view(-1, BLOCK)
    absmax_n = x_nB.abs().amax(1)
    y = x_nB / torch.where(absmax_n > 0, absmax_n, torch.ones(()))[:, None]
    top = (y.reshape(-1).view(torch.int32).long() >> (32 - TABLE_BITS)) & TABLE_MASK
    centre = _bucket_centres()[top].reshape(-1, 1)
    dist = (centre - dynamic_map(signed).double()[None, :]).abs()
    q = dist.argmin(1)           # the first (lower) of equally near codes
    return q.to(torch.uint8), absmax_n


class StateCodec:
    """Decode rows of a StateFormat into fp32 buffers and encode them back (one thread)."""

    def __init__(self, fmt: StateFormat) -> None:
        self.fmt = fmt
        self._buf: dict[str, torch.Tensor] = {}
        self._noise: torch.Tensor | None = None

    def buffer(self, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
        """A kept work buffer of at least numel elements (the first numel of it)."""
        buf = self._buf.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buf[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    # ------------------------------------------------------------------ master
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
        if self.fmt.master == "fp32":
            if master_P.data_ptr() != row.data_ptr():
                row.copy_(master_P)
            return
        bits = master_P.view(torch.int32)
        noise = self._noise_table()
        for i, start in enumerate(range(0, bits.numel(), NOISE_NUMBERS)):
            part = bits[start:start + NOISE_NUMBERS]
            off = _mix(self.fmt.seed, *where, i) % NOISE_NUMBERS
            part.add_(noise[off:off + part.numel()])
        bits.bitwise_and_(-65536)            # the low 16 bits: now exact in bf16
        row.copy_(master_P)

    def _noise_table(self) -> torch.Tensor:
        """int32 [2 NOISE_NUMBERS]: uniform in [0, 65536), from the format's seed, twice."""
        if self._noise is None:
            gen = torch.Generator().manual_seed(_mix(self.fmt.seed, 0x5EED) & (2 ** 63 - 1))
            half = torch.randint(0, 65536, (NOISE_NUMBERS,), dtype=torch.int32, generator=gen)
            self._noise = torch.cat([half, half])
        return self._noise

    # ------------------------------------------------------------------ moments
    def decode_moment(self, row: torch.Tensor, numel: int, signed: bool, slot: str,
                      out_P: torch.Tensor | None = None) -> torch.Tensor:
        """A moment as fp32 [P]: the row itself for fp32, else decoded into out_P / a buffer
        named slot."""
        kind = self.fmt.moments
        if kind == "fp32" and out_P is None:
            return row
        out_P = self.buffer(slot, numel) if out_P is None else out_P
        if kind != "int8":
            return out_P.copy_(row)
        nb = -(-numel // BLOCK)
        codes, scale_n = row[:nb * BLOCK], row[nb * BLOCK:].view(torch.float32)
        idx = self.buffer("idx", nb * BLOCK, torch.int32).copy_(codes)
        full = self.buffer(slot + ".full", nb * BLOCK) if numel % BLOCK else out_P
        torch.index_select(dynamic_map(signed), 0, idx, out=full)
        full.view(nb, BLOCK).mul_(scale_n[:, None])
        if full is not out_P:
            out_P.copy_(full[:numel])
        return out_P

    def encode_moment(self, value_P: torch.Tensor, row: torch.Tensor, signed: bool) -> None:
        """Write fp32 value_P into a moment row (value_P may be used as scratch)."""
        kind = self.fmt.moments
        if kind == "fp32":
            if value_P.data_ptr() != row.data_ptr():
                row.copy_(value_P)
            return
        if kind == "bf16":
            row.copy_(value_P)
            return
        numel = value_P.numel()
        nb = -(-numel // BLOCK)
        x = value_P
        if numel % BLOCK:       # pad the last block with zeros
            x = self.buffer("pad", nb * BLOCK)
            x[:numel].copy_(value_P)
            x[numel:].zero_()
        codes, scale_n = row[:nb * BLOCK], row[nb * BLOCK:].view(torch.float32)
        x_nB = x.view(nb, BLOCK)
        torch.amax(x_nB, 1, out=scale_n)
        if signed:          # |x|'s max from max and min: two reductions, no |x| pass
            low_n = torch.amin(x_nB, 1, out=self.buffer("low", nb).view(nb))
            torch.maximum(scale_n, low_n.neg_(), out=scale_n)
            scale_n.add_(0.0)   # -0.0 (a block of zeros) -> +0.0, as |x|'s max would be
        denom = torch.where(scale_n > 0, scale_n, torch.ones((), dtype=torch.float32))
        y = self.buffer("y", nb * BLOCK)
        torch.div(x_nB, denom[:, None], out=y.view(nb, BLOCK))
        idx = self.buffer("idx", nb * BLOCK, torch.int32)
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
