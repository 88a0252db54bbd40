"""Cost model for the pipelined all-to-all: memory per strategy, measured rates, time prediction.

Memory. What decides is the per-rank PEAK of one layer step (forward + backward), which
`moescale.parallel.memory_model` computes from the buffers the code allocates
(`pipelined_peak_bytes`, `unpipelined_peak_bytes`) and `moescale bench ep-memory` checks
against the peak RSS it measures (within 10%). `memory_bytes` below is MPipeMoE's own
accounting of what a strategy keeps for backward (S rows received by this rank's experts,
D model width, F hidden width, G = 2 for GLU experts else 1, b bytes per element, C chunks):

  what backward needs   DI = S*D*b (dispatched input)        H = G*S*F*b (expert hidden)
  none                  device: DI + H                         buffers: 0
  S1 / S2 / S3 / S4     device: 0 (offloaded to host, re-communicated or recomputed)
                        buffers: min(3, C) * ceil(S/C) * D * b (the forward's receive slots)
  host (offloaded)      S1: DI + H, S2: DI, S3: H, S4: 0

it sets the offload copy time below; it is not the peak (weight gradients, output gradients,
the exchanges' send and receive rows and the kernels' block buffers are also alive then).

Time (one forward + backward of the layer's exchange and experts):

  T_comp = flops / gemm_rate, flops = 2*S*D*F*(G+1) forward, twice that backward, plus the
           recomputed GEMM 1 (2*S*D*F*G) for S2/S4
  T_comm = per exchange C*latency + (S*D*b*(W-1)/W) / bandwidth; 4 exchanges (dispatch,
           combine, their two backward), 5 with re-communication (S3/S4)
  T_copy = 2 * offloaded bytes / copy bandwidth (out in forward, back in backward); 0 on a
           CPU, where an offloaded tensor stays where it is
  T      = max(T_comp, T_comm) + min(T_comp, T_comm) / C + T_copy

The overlap term says a C-chunk pipeline hides all but one chunk of the shorter stage.
Rates come from `measure_rates` (timed GEMM, two all-to-all sizes for latency and bandwidth, a
copy), maximized over the EP group so every rank predicts the same and picks the same.

`choose_strategy` picks the fastest predicted strategy among those whose peak is at most the
unpipelined dispatcher's (so `auto` never costs memory; when none is, the unpipelined
dispatcher itself) and, when given, at most the memory limit; measured peaks (from
`moescale bench ep-memory`) replace the formulas when supplied. When nothing fits at the given
chunk count it raises a ValueError naming the fewest chunks at which something would (the
dispatcher's chunks="auto" only tries counts where something fits: `chunks_that_fit`).

It does not model the router, attention or the combine's index_add (the same for every choice).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from moescale.parallel.all_to_all import collective_errors, start_all_to_all
from moescale.parallel.memory_model import (MAX_CHUNKS, STRATEGIES, STRATEGY_NAMES,
                                            LayerShape, pipelined_peak_bytes,
                                            smallest_fitting_chunks, unpipelined_peak_bytes)

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "LayerShape", "MemoryEstimate", "Rates",
           "TimeEstimate", "choose_strategy", "measure_rates", "memory_bytes",
           "predict_seconds"]


@dataclass
class MemoryEstimate:
    device_saved: int         # kept on the device for backward
    buffers: int              # pipeline receive slots on the device
    host: int                 # offloaded to host memory

    @property
    def device_total(self) -> int:
        return self.device_saved + self.buffers


def memory_bytes(shape: LayerShape, strategy: str, chunks: int) -> MemoryEstimate:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown; use one of {STRATEGY_NAMES}")
    di_mode, h_mode = STRATEGIES[strategy]
    g = 2 if shape.glu else 1
    di = shape.rows * shape.d_model * shape.elem_bytes
    h = g * shape.rows * shape.d_ff * shape.elem_bytes
    saved = (di if di_mode == "keep" else 0) + (h if h_mode == "keep" else 0)
    host = (di if di_mode == "offload" else 0) + (h if h_mode == "offload" else 0)
    buffers = 0
    if strategy != "none":
        buffers = min(3, chunks) * math.ceil(shape.rows / chunks) * shape.d_model * \
            shape.elem_bytes
    return MemoryEstimate(device_saved=saved, buffers=buffers, host=host)


@dataclass
class Rates:
    gemm_flops: float          # flop/s of the expert GEMMs
    a2a_latency_s: float       # fixed cost of one all-to-all
    a2a_bytes_per_s: float     # bytes a rank sends per second in an all-to-all
    copy_bytes_per_s: float    # device <-> host copy bandwidth (a memcpy on CPU)


@dataclass
class TimeEstimate:
    comp_s: float
    comm_s: float
    copy_s: float
    total_s: float


def predict_seconds(shape: LayerShape, rates: Rates, strategy: str, chunks: int) -> TimeEstimate:
    di_mode, h_mode = STRATEGIES[strategy]
    g = 2 if shape.glu else 1
    flops = 3 * 2 * shape.rows * shape.d_model * shape.d_ff * (g + 1)
    if h_mode == "recompute":
        flops += 2 * shape.rows * shape.d_model * shape.d_ff * g
    comp = flops / rates.gemm_flops
    frac = (shape.ep_size - 1) / shape.ep_size
    exchange = chunks * rates.a2a_latency_s + \
        shape.rows * shape.d_model * shape.elem_bytes * frac / rates.a2a_bytes_per_s
    comm = exchange * (5 if di_mode == "recomm" else 4)
    copy = 0.0 if shape.host_is_device else \
        2 * memory_bytes(shape, strategy, chunks).host / rates.copy_bytes_per_s
    total = max(comp, comm) + min(comp, comm) / chunks + copy
    return TimeEstimate(comp, comm, copy, total)


def choose_strategy(shape: LayerShape, rates: Rates, chunks: int,
                    memory_limit_bytes: float | None = None,
                    candidates: tuple[str, ...] = STRATEGY_NAMES,
                    peaks: Mapping[str, float] | None = None) -> tuple[str, list[dict]]:
    """The fastest predicted configuration whose per-rank peak is at most the unpipelined
    dispatcher's and at most `memory_limit_bytes`; (name, table of all).

    The candidates are the pipelined strategies at `chunks` and "unpipelined" (the plain
    dispatcher: no overlap, so predicted like `none` at one chunk). Ties go to the earlier
    candidate, so the unpipelined dispatcher is picked only when no strategy fits or it is
    predicted strictly faster. `peaks` (optional): measured peak bytes per strategy name at
    this chunk count and under "unpipelined"; any entry given replaces the formula."""
    peaks = peaks or {}
    baseline = peaks.get("unpipelined", unpipelined_peak_bytes(shape))
    table = []
    for name in tuple(candidates) + ("unpipelined",):
        plain = name == "unpipelined"
        peak = baseline if plain else peaks.get(name, pipelined_peak_bytes(shape, name, chunks))
        mem = memory_bytes(shape, "none" if plain else name, chunks)
        t = predict_seconds(shape, rates, "none", 1) if plain else \
            predict_seconds(shape, rates, name, chunks)
        table.append(dict(strategy=name, peak_bytes=int(peak), unpipelined_bytes=int(baseline),
                          fits=peak <= baseline and (memory_limit_bytes is None or
                                                     peak <= memory_limit_bytes),
                          measured=name in peaks, kept_bytes=mem.device_total,
                          host_bytes=0 if plain else mem.host, **asdict(t)))
    fitting = [row for row in table if row["fits"]]
    if not fitting:
        smallest = min(table, key=lambda row: row["peak_bytes"])
        more = smallest_fitting_chunks(shape, memory_limit_bytes, candidates, start=chunks + 1,
                                       peaks={chunks: peaks} if peaks else None)
        fix = f"use chunks={more} (the fewest that fit) or chunks='auto'" if more else \
            f"no chunk count up to {MAX_CHUNKS} fits: raise the limit"
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes:g} is below every strategy's "
                         f"per-rank peak at chunks={chunks} (smallest: {smallest['strategy']} "
                         f"with {smallest['peak_bytes']} bytes); {fix}")
    best = min(fitting, key=lambda row: (row["total_s"], table.index(row)))
    return best["strategy"], table


def _timed(fn, repeats: int) -> float:
    fn()                                   # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(groups, *, d_model: int, d_ff: int, rows: int, device=None,
                  dtype: torch.dtype = torch.float32, repeats: int = 3) -> Rates:
    """Time a GEMM, a 1-row and a `rows`-row all-to-all, and a copy; the slowest rank's numbers.

    Collective over the EP group: every rank of it must call this together.
    """
    W, group = groups.ep_size, groups.ep_group
    sync = torch.cuda.synchronize if device is not None and torch.device(device).type == "cuda" \
        else (lambda: None)
    a = torch.randn(rows, d_model, device=device, dtype=dtype)
    b = torch.randn(d_model, d_ff, device=device, dtype=dtype)

    def gemm():
        torch.mm(a, b)
        sync()

    def a2a(n):
        x = torch.zeros(n * W, d_model, device=device, dtype=dtype)
        return lambda: (start_all_to_all(x, [n] * W, [n] * W, group, "rate probe").wait(),
                        sync())

    h = torch.randn(rows, d_ff, device=device, dtype=dtype)

    def copy():
        h.to("cpu", copy=True)
        sync()

    per_rank = max(1, rows // W)
    times = torch.tensor([_timed(gemm, repeats), _timed(a2a(1), repeats),
                          _timed(a2a(per_rank), repeats), _timed(copy, repeats)],
                         dtype=torch.float64, device=device)
    with collective_errors("rate measurement", group):
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    t_gemm, t_small, t_large, t_copy = times.tolist()
    elem = a.element_size()
    sent = per_rank * (W - 1) * d_model * elem
    return Rates(gemm_flops=2 * rows * d_model * d_ff / max(t_gemm, 1e-9),
                 a2a_latency_s=t_small,
                 a2a_bytes_per_s=max(sent, 1) / max(t_large - t_small, 1e-9),
                 copy_bytes_per_s=rows * d_ff * elem / max(t_copy, 1e-9))
