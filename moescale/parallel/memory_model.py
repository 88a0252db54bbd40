"""Per-rank peak memory of one expert-parallel MoE layer step (forward + backward), by formula.

The formulas follow the buffers the code allocates, point by point of its schedule, and take
the largest sum; `moescale bench ep-memory` checks each one against the peak RSS it measures
(within 10%). A point lists what is alive there; everything is in bytes, per rank, above what
exists before the step (parameters and the layer input).

Unpipelined (`ExpertParallelDispatcher`: gather, all-to-all, experts, all-to-all, combine):
  end of forward   the dispatcher's rows x_RD, x_SD, x_local (saved), y_local, y_SD, y_RD
                   (saved by the combine), the weighted rows, and the combine's two T-row
                   outputs, plus the saved hidden H = G*S*F*b
  experts backward x_local, H, their output gradient and input gradient (S rows each), the
                   weight gradients, the kernels' block buffers (ga, a1, GLU a; <= 16 MiB each)
  combine backward x_local, H, y_RD, gy_TD and three R-row products
Pipelined (`PipelinedAllToAll`, C chunks; s = ceil(S/C), r = ceil(R/C) rows per chunk):
  forward, chunk k y_TD; the receive slots (3 rotating when the strategy does not keep the
                   received rows, else the chunk's receive buffers and fresh output rows);
                   chunk k+1's sent rows, chunk k-1's returning rows; what the strategy keeps
                   of chunks 0..k; the block buffers
  backward, chunk k gy_TD, the weight gradients, dx_TD (once a chunk is collected), the
                   output-gradient slots (3 with none, 2 with reuse), 2 re-dispatch slots
                   (S3/S4), chunk k+1's sent rows, chunk k-1's returning input gradients
                   (none only); what is kept of chunks k..C-1; the block buffers (<= 4 MiB
                   each, `pipeline_block_rows`)
On a CPU host memory is the device memory: offloaded bytes count (S1 holds what none holds).
The caller is assumed not to hold the layer's output during backward (its next layer keeps
its own input), and its loss to add at most one T-row tensor at the end of forward.

Fitting a memory limit: `lowest_peak` is the leanest configuration at a chunk count,
`chunks_that_fit` the chunk counts an automatic choice may use under a limit (more chunks than
its candidates when none of them fits), `smallest_fitting_chunks` the count an error names.

Not modelled: the router and the routing plan (T*E and R-sized index tensors, under 1% at
realistic widths), allocator slack, and experts whose rows are far above the mean (block
buffers are sized by the mean rows per expert).

Legend: T tokens, R rows sent, S rows received, D model width, F expert hidden width, G = 2 for
GLU else 1, L experts per rank, b bytes per element, C chunks, n rows per kernel block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from moescale.layers.grouped_ffn import chunk_rows

# Expert GEMM blocks of the pipeline: about this many bytes per [rows, F] fp32 block buffer.
# Smaller than the kernels' default (grouped_ffn.CHUNK_BYTES): a recomputing strategy holds
# its hidden only as block buffers, and they are part of the per-rank peak.
BLOCK_BYTES = 4 << 20
MIN_BLOCK_ROWS = 64


def pipeline_block_rows(d_ff: int) -> int:
    """Rows per expert GEMM block in the pipeline, for hidden width d_ff."""
    return max(MIN_BLOCK_ROWS, BLOCK_BYTES // (4 * max(d_ff, 1)))


STRATEGY_NAMES = ("none", "S1", "S2", "S3", "S4")
STRATEGIES = MappingProxyType({   # read-only: (dispatched input, hidden)
    "none": ("keep", "keep"),
    "S1": ("offload", "offload"),
    "S2": ("offload", "recompute"),
    "S3": ("recomm", "offload"),
    "S4": ("recomm", "recompute"),
})


@dataclass(kw_only=True)
class LayerShape:
    """One layer call as the memory and time models see it (per rank)."""

    rows: int                     # S: rows this rank's experts receive
    d_model: int
    d_ff: int
    glu: bool = False
    elem_bytes: int = 4           # compute dtype
    ep_size: int = 1
    tokens: int | None = None     # T: tokens of this rank (default: rows_sent / 2, top-2)
    rows_sent: int | None = None  # R: rows this rank sends (default: rows)
    num_local_experts: int = 1
    bias: bool = False
    work_bytes: int | None = None  # the kernels' elementwise dtype (default: elem_bytes)
    host_is_device: bool = True   # CPU: offloaded bytes stay in the same memory
    workers: int = 1              # expert worker threads, each with its own block buffers

    def __post_init__(self) -> None:
        if self.rows_sent is None:
            self.rows_sent = self.rows
        if self.tokens is None:
            self.tokens = math.ceil(self.rows_sent / 2)
        if self.work_bytes is None:
            self.work_bytes = self.elem_bytes
        for name in ("rows", "tokens", "rows_sent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        for name in ("d_model", "d_ff", "elem_bytes", "ep_size", "num_local_experts",
                     "work_bytes", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @property
    def permuted(self) -> bool:
        """Received rows need reordering (several sources and several local experts)."""
        return self.ep_size > 1 and self.num_local_experts > 1

    @property
    def weight_bytes(self) -> int:
        g = 2 if self.glu else 1
        w = self.num_local_experts * (g + 1) * self.d_model * self.d_ff
        if self.bias:
            w += self.num_local_experts * (self.d_ff + self.d_model)
        return w * self.elem_bytes


def _block_bytes(p: LayerShape, n: int, backward: bool, recompute: bool,
                 row_copies: int) -> int:
    """The kernels' buffers over all workers: [n, F] buffers (backward ga, a1, GLU a; forward
    a; h32 when upcasting; the recomputed hidden) and `row_copies` [n, D] block copies."""
    g = 2 if p.glu else 1
    lowp = p.work_bytes != p.elem_bytes
    hidden = ((2 + (g - 1)) if backward else 1) * n * p.d_ff * p.work_bytes
    hidden += lowp * n * p.d_ff * p.work_bytes
    if recompute:
        hidden += g * n * p.d_ff * p.elem_bytes
    return p.workers * (hidden + row_copies * n * p.d_model * p.work_bytes)


def unpipelined_peak_bytes(p: LayerShape) -> int:
    """Per-rank peak of `ExpertParallelDispatcher` + grouped experts + combine, fwd + bwd."""
    row, g = p.d_model * p.elem_bytes, 2 if p.glu else 1
    R, S, T = p.rows_sent, p.rows, p.tokens
    hidden = g * S * p.d_ff * p.elem_bytes
    copies = 4 if p.permuted else 2          # x_SD, x_local, y_local, y_SD (or 2 aliases)
    end_fwd = (3 * R + copies * S + 2 * T) * row + hidden
    n = min(chunk_rows(p.d_ff), max(1, math.ceil(S / p.num_local_experts)))
    experts_bwd = 3 * S * row + hidden + p.weight_bytes + \
        _block_bytes(p, n, backward=True, recompute=False, row_copies=0)
    combine_bwd = (T + S + 4 * R) * row + hidden
    return max(end_fwd, experts_bwd, combine_bwd)


def pipelined_peak_bytes(p: LayerShape, strategy: str, chunks: int) -> int:
    """Per-rank peak of `PipelinedAllToAll` (combine included) with `chunks` and `strategy`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive integer")
    di, h = STRATEGIES[strategy]
    C, row, g = chunks, p.d_model * p.elem_bytes, 2 if p.glu else 1
    s, r, T = math.ceil(p.rows / C), math.ceil(p.rows_sent / C), p.tokens
    here = ("keep",) + (("offload",) if p.host_is_device else ())
    di_kept, h_kept = (di in here) * s * row, (h in here) * g * s * p.d_ff * p.elem_bytes
    h_chunk = (h != "recompute") * g * s * p.d_ff * p.elem_bytes   # written during compute
    n = min(pipeline_block_rows(p.d_ff), max(1, math.ceil(s / p.num_local_experts)))
    # block copies: forward x gather, y block; backward x, gy gathers, gy*scale, dx block
    fwd_blocks = _block_bytes(p, n, backward=False, recompute=h == "recompute",
                              row_copies=2 * p.permuted)
    bwd_blocks = _block_bytes(p, n, backward=True, recompute=h == "recompute",
                              row_copies=3 * p.permuted + 1)
    # reloaded copies of chunk k on an accelerator (offloaded to host in forward)
    reload = (not p.host_is_device) * ((di == "offload") * s * row +
                                       (h == "offload") * g * s * p.d_ff * p.elem_bytes)
    points = [2 * T * row + C * (di_kept + h_kept)]          # end of forward (+ the caller's)
    for k in range(C):
        nxt, prev = k + 1 < C, k > 0
        live = T * row + (k + 1) * (di_kept + h_kept) + max(0, h_chunk - h_kept) + fwd_blocks
        live += nxt * r * row + prev * r * row               # sent rows k+1, returning k-1
        if di in here:     # received rows kept; outputs in fresh buffers
            live += (nxt + 1 + prev) * s * row
        else:              # three rotating slots, outputs in place
            live += min(3, C, k + 2) * s * row
        points.append(live)
        # backward; with reuse ("lean") chunk k-1's gradients are collected before chunk k+1's
        # exchanges start: two output-gradient slots, nothing returning during compute k
        lean = strategy != "none"
        recomm = di == "recomm"
        kept = (C - k) * (di_kept + h_kept)
        has_dx = k >= 1 if lean else k >= 2               # dx_TD exists (first collect done)
        rings = min(2 if lean else 3, C, k + 2) * s * row + recomm * min(2, C, k + 2) * s * row
        sent = nxt * r * row * (1 + recomm)               # chunk k+1's gathered rows
        back = (not lean) * prev * r * row                # chunk k-1's returning gradients
        base = T * row + p.weight_bytes + has_dx * T * row
        points.append(base + rings + sent + back + kept + reload + bwd_blocks)
        if lean:           # collecting chunk k-1 before chunk k+1's exchanges
            points.append(base + rings + prev * r * row + kept)
        else:              # collecting chunk k-1 after chunk k's return exchange started
            points.append(base + (k == 1) * T * row + rings + sent + (1 + prev) * r * row
                          + kept - di_kept - h_kept)
    return max(points)


# The most chunks the auto choice and the error messages consider (the peak stops falling once
# a chunk holds a few rows; each chunk costs an all-to-all latency per exchange).
MAX_CHUNKS = 256


def peak_at(p: LayerShape, strategy: str, chunks: int,
            peaks: Mapping[int, Mapping[str, float]] | None = None) -> float:
    """Per-rank peak of `strategy` ("unpipelined": the plain dispatcher) at `chunks`: the measured
    value from `peaks` ({chunks: {strategy: bytes}}) when given, else the formula."""
    measured = (peaks or {}).get(chunks, {})
    if strategy in measured:
        return measured[strategy]
    if strategy == "unpipelined":
        unpiped = [m["unpipelined"] for m in (peaks or {}).values() if "unpipelined" in m]
        return unpiped[0] if unpiped else unpipelined_peak_bytes(p)
    return pipelined_peak_bytes(p, strategy, chunks)


def lowest_peak(p: LayerShape, chunks: int, strategies: Iterable[str], *, plain: bool = True,
                peaks: Mapping[int, Mapping[str, float]] | None = None) -> tuple[str, float]:
    """(name, bytes) of the leanest configuration at `chunks`: one of `strategies`, or with
    `plain` the unpipelined dispatcher too (what strategy="auto" may fall back to)."""
    names = tuple(strategies) + (("unpipelined",) if plain else ())
    return min(((n, peak_at(p, n, chunks, peaks)) for n in names), key=lambda nb: nb[1])


def smallest_fitting_chunks(p: LayerShape, limit: float, strategies: Iterable[str], *,
                            start: int = 1, plain: bool = True,
                            peaks: Mapping[int, Mapping[str, float]] | None = None,
                            max_chunks: int = MAX_CHUNKS) -> int | None:
    """The smallest chunk count in [start, max_chunks] at which some configuration's peak is at
    most `limit` (see `lowest_peak`), or None."""
    strategies = tuple(strategies)
    for c in range(max(1, start), max_chunks + 1):
        if lowest_peak(p, c, strategies, plain=plain, peaks=peaks)[1] <= limit:
            return c
    return None


def chunks_that_fit(p: LayerShape, limit: float | None, candidates: Iterable[int],
                    strategies: Iterable[str], *, plain: bool = True,
                    peaks: Mapping[int, Mapping[str, float]] | None = None) -> tuple[int, ...]:
    """The chunk counts the auto choice may use under `limit`: the candidates at which some
    configuration fits; when none does, the first count of the doubling series after the
    largest candidate (16, 32, ... up to MAX_CHUNKS) that fits, alone. All candidates when
    `limit` is None. Raises ValueError when no count up to MAX_CHUNKS fits."""
    candidates, strategies = tuple(sorted(set(candidates))), tuple(strategies)
    if limit is None:
        return candidates
    fit = tuple(c for c in candidates
                if lowest_peak(p, c, strategies, plain=plain, peaks=peaks)[1] <= limit)
    if fit:
        return fit
    c = max(candidates)
    while c < MAX_CHUNKS:
        c = min(2 * c, MAX_CHUNKS)
        if lowest_peak(p, c, strategies, plain=plain, peaks=peaks)[1] <= limit:
            return (c,)
    name, peak = lowest_peak(p, MAX_CHUNKS, strategies, plain=plain, peaks=peaks)
    raise ValueError(f"memory_limit_bytes={limit:g} is below the per-rank peak of every "
                     f"configuration ({', '.join(strategies)}{', unpipelined' if plain else ''})"
                     f" at every chunk count up to {MAX_CHUNKS} (the lowest: {name} with "
                     f"{int(peak)} bytes at {MAX_CHUNKS} chunks, for {p.rows} rows of "
                     f"d_model {p.d_model}, d_ff {p.d_ff}); raise the limit to at least "
                     f"{int(peak)} bytes or send fewer tokens per call")
