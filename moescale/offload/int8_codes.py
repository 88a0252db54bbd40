"""The int8 block-wise moment codes (Dettmers et al. 2021, arXiv 2110.02861): the dynamic tree
map, the table that finds a number's nearest code, the table that decodes two codes at once, and
the quantiser by its definition (slow, for tests).

A moment is quantised per block of BLOCK numbers: divided by the block's absolute maximum (kept as
an fp32 scale) and mapped to the nearest of 256 codes (signed for exp_avg, unsigned for
exp_avg_sq). "Nearest" is taken of the centre of the fp32 numbers that share the normalised
value's top TABLE_BITS bits (sign, exponent, 11 mantissa bits), through a 2^TABLE_BITS-entry
table indexed by those bits: a shift and one gather per number instead of a search. The codes
are bf16 numbers, so dequantise -> quantise is the identity, bitwise.

Decoding gathers two numbers per lookup: the 16 bits of two adjacent codes index a 2^16-entry
table of their two fp32 values packed in one int64 (half the gathers of a 256-entry table, which
on this CPU is the decode's whole cost).

Deliberately not here: the record layout and the codec's chunked kernels (state_format.py).
"""

from __future__ import annotations

from functools import lru_cache

import torch

BLOCK = 256                     # numbers per int8 quantisation block (one fp32 scale each)
TABLE_BITS = 20                 # int8 codes are looked up by an fp32 number's top 20 bits (a
TABLE_MASK = (1 << TABLE_BITS) - 1   # 1 MiB table: buckets of 2^-11 relative, finer than the
                                     # codes' spacing, so dequantise -> quantise is exact)


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


@lru_cache(maxsize=2)
def pair_table(signed: bool) -> torch.Tensor:
    """int64 [2^16]: for every 16-bit value of two adjacent codes as memory holds them (read as
    uint16), the two codes' fp32 values in the same memory order, as one int64."""
    bytes_J2 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    pairs_J2 = dynamic_map(signed)[bytes_J2.view(-1, 2).long()]     # fp32 [2^16, 2]
    return pairs_J2.contiguous().view(torch.int64).reshape(-1)
