"""The pipelined expert-parallel exchange (MPipeMoE): chunked all-to-all overlapped with experts.

`PipelinedAllToAll` is one autograd Function covering dispatch, the local grouped experts and
the return exchange, with a hand-written, hand-pipelined backward:

  forward   chunk k+1's dispatch all-to-all is in flight (async) while chunk k's experts run;
            chunk k's result goes back on a second process group (the combine group), so the
            two directions never queue behind each other.
  backward  chunk k+1's output gradient travels (combine group) while chunk k's expert
            backward runs; chunk k's input gradient goes back on the dispatch group.

Chunks are cut inside every (peer, expert) bin: a bin of n rows is cut into C pieces, piece j
= rows [n*j//C, n*(j+1)//C), and chunk k takes piece (k + s*L + l) mod C of the bin that source
rank s sends to local expert l. The rotation spreads the bins' larger pieces over the chunks, so
each chunk receives ceil(S/C) rows give or take one (without it, chunk C-1 would take the larger
piece of every bin: up to S/C + W*L rows). Sender and receiver know n (the counts exchange) and
(s, l), so both compute the same cuts: no padding, no extra messages, one exchange per chunk and
direction.

Memory reuse (MPipeMoE's strategies; `none` keeps everything per chunk). What backward needs
of each chunk is the dispatched input (DI) and the expert hidden (H):

  strategy   DI                                  H
  none       kept (one buffer per chunk)         kept
  S1         offloaded to host, reloaded         offloaded, reloaded
  S2         offloaded, reloaded                 recomputed (GEMM 1 re-run)
  S3         re-communicated (dispatch re-run)   offloaded, reloaded
  S4         re-communicated                     recomputed

With a strategy other than `none` the forward receives every chunk into one of two rotating
receive buffers (double buffering: chunk k computes while k+1 arrives), and nothing per chunk
stays on the device. Offloaded copies are synchronous (correct everywhere; overlapping them on
a side stream is not done yet).

Gradient scale: as in `ExpertParallelDispatcher`, expert weight gradients are multiplied by
1/W (the ranks' losses are averaged); input gradients are not.

Legend: T tokens, R rows sent (grouped by global expert), S rows received in one chunk,
D model width, F expert hidden width, W ranks of the EP group, L experts per rank, C chunks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from moescale.dispatch.local import combine_rows
from moescale.dispatch.plan import RoutingPlan
from moescale.layers.experts import GroupedExperts, compute_dtype
from moescale.layers.grouped_ffn import FFNWeights, ffn_backward, ffn_forward, mm_into, segments
from moescale.parallel.all_to_all import exchange_counts, start_all_to_all
from moescale.parallel.cost_model import (STRATEGIES, LayerShape, Rates, choose_strategy,
                                          measure_rates)
from moescale.parallel.expert_parallel import (ExpertParallelDispatcher, expert_major_order,
                                               inverse_permutation, segments_index)
from moescale.parallel.groups import ParallelGroups
from moescale.parallel.tuner import ChunkTuner, TunerConfig, bucket_of


def _cut(n: int, k: int, num_chunks: int, rotation: int) -> tuple[int, int]:
    """Rows [lo, hi) of an n-row bin that chunk k takes (its piece (k + rotation) mod C)."""
    j = (k + rotation) % num_chunks
    return n * j // num_chunks, n * (j + 1) // num_chunks


def _piece(n: int, k: int, num_chunks: int, rotation: int) -> int:
    lo, hi = _cut(n, k, num_chunks, rotation)
    return hi - lo


@dataclass
class ChunkLayout:
    """One chunk: what this rank sends (rows of the plan, their tokens) and receives."""

    send_splits: list[int]
    recv_splits: list[int]
    row_idx: torch.Tensor            # positions in the plan's row order (R) of the sent rows
    token_idx: torch.Tensor          # their tokens
    perm: torch.Tensor | None        # received (source-major) -> expert-major
    inv_perm: torch.Tensor | None
    local_counts: list[int]          # rows per local expert in this chunk

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)


def chunk_layouts(send_WL: list[list[int]], recv_WL: list[list[int]],
                  token_idx_R: torch.Tensor, num_chunks: int, rank: int) -> list[ChunkLayout]:
    """Cut every (peer, expert) bin into num_chunks pieces (no padding); `rank` is this rank's
    index in the EP group (the bins it sends are (rank, l) to their receivers)."""
    device = token_idx_R.device
    W, L = len(send_WL), len(send_WL[0])
    offsets, off = {}, 0
    for p in range(W):
        for l in range(L):
            offsets[p, l] = off
            off += send_WL[p][l]
    layouts = []
    for k in range(num_chunks):
        starts, lengths, send_splits = [], [], []
        for p in range(W):
            sent = 0
            for l in range(L):
                lo, hi = _cut(send_WL[p][l], k, num_chunks, rank * L + l)
                starts.append(offsets[p, l] + lo)
                lengths.append(hi - lo)
                sent += hi - lo
            send_splits.append(sent)
        recv_piece_WL = [[_piece(recv_WL[s][l], k, num_chunks, s * L + l) for l in range(L)]
                         for s in range(W)]
        row_idx = segments_index(list(zip(starts, lengths)), sum(lengths), device)
        if row_idx is None:
            row_idx = torch.arange(sum(lengths), device=device)
        perm, local_counts = expert_major_order(recv_piece_WL, device)
        layouts.append(ChunkLayout(
            send_splits=send_splits, recv_splits=[sum(r) for r in recv_piece_WL],
            row_idx=row_idx, token_idx=token_idx_R.index_select(0, row_idx), perm=perm,
            inv_perm=None if perm is None else inverse_permutation(perm),
            local_counts=local_counts))
    return layouts


@dataclass
class PipelineSpec:
    """Everything the Function needs besides tensors (host data and groups)."""

    layouts: list[ChunkLayout]
    groups: ParallelGroups
    strategy: str
    num_rows: int                      # R: rows of the plan on this rank
    grad_scale: float                  # multiplies expert weight gradients
    stats: dict = field(default_factory=dict)   # filled in: buffer bytes, offloaded bytes
    trace: list | None = None          # if a list: (event, chunk) in issue order (for tests)

    def note(self, event: str, chunk: int) -> None:
        if self.trace is not None:
            self.trace.append((event, chunk))


def _offload(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t)


def _reload(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _hidden(x_RD: torch.Tensor, counts, w: FFNWeights):
    """Recompute (h1_RF, h3_RF) exactly as ffn_forward does."""
    hidden = w.w1_EDF.shape[2]
    h1_RF = x_RD.new_empty(x_RD.shape[0], hidden)
    h3_RF = x_RD.new_empty(x_RD.shape[0], hidden) if w.w3_EDF is not None else None
    for e, s, t in segments(counts):
        mm_into(h1_RF[s:t], x_RD[s:t], w.w1_EDF[e], None if w.b1_EF is None else w.b1_EF[e])
        if h3_RF is not None:
            mm_into(h3_RF[s:t], x_RD[s:t], w.w3_EDF[e])
    return h1_RF, h3_RF


def _reorder(t: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return t if perm is None else t.index_select(0, perm)


class _Dispatcher:
    """Launches chunk k's dispatch; with reuse, into one of two rotating receive buffers."""

    def __init__(self, x_TD: torch.Tensor, spec: PipelineSpec, reuse: bool) -> None:
        self.x_TD, self.spec = x_TD, spec
        self.slots = None
        if reuse:
            rows = max((lay.num_recv for lay in spec.layouts), default=0)
            self.slots = [x_TD.new_empty(rows, x_TD.shape[1])
                          for _ in range(min(2, len(spec.layouts)))]
            spec.stats["recv_buffer_bytes"] = sum(s.numel() * s.element_size()
                                                  for s in self.slots)

    def start(self, k: int, what: str):
        self.spec.note(what, k)
        lay = self.spec.layouts[k]
        out = None if self.slots is None else self.slots[k % len(self.slots)][:lay.num_recv]
        return start_all_to_all(self.x_TD.index_select(0, lay.token_idx), lay.send_splits,
                                lay.recv_splits, self.spec.groups.ep_group, what, out=out)


def forward_chunks(spec: PipelineSpec, disp: _Dispatcher, y_RD: torch.Tensor,
                   compute) -> None:
    """The forward skeleton shared by the grouped and the module pipelines: chunk k+1's
    dispatch is in flight while chunk k computes, and chunk k's result travels back on the
    combine group while chunk k+1 computes. `compute(k, layout, x_loc)` returns the chunk's
    expert outputs (expert-major rows); the results land in y_RD (plan row order)."""
    lays = spec.layouts
    pending, back = disp.start(0, "pipelined dispatch"), None
    for k, lay in enumerate(lays):
        x_recv = pending.wait()
        if k + 1 < len(lays):
            pending = disp.start(k + 1, "pipelined dispatch")
        spec.note("experts forward", k)
        y_loc = compute(k, lay, _reorder(x_recv, lay.perm))
        del x_recv
        spec.note("pipelined combine", k)
        ret = start_all_to_all(_reorder(y_loc.to(y_RD.dtype), lay.inv_perm), lay.recv_splits,
                               lay.send_splits, spec.groups.ep_combine_group,
                               "pipelined combine")
        del y_loc
        if back is not None:
            y_RD.index_copy_(0, lays[back[0]].row_idx, back[1].wait())
        back = (k, ret)
    y_RD.index_copy_(0, lays[back[0]].row_idx, back[1].wait())


def backward_chunks(spec: PipelineSpec, gy_RD: torch.Tensor, x_TD: torch.Tensor | None,
                    compute, need_dx: bool, num_tokens: int) -> torch.Tensor | None:
    """The backward skeleton shared by both pipelines: chunk k+1's output gradients travel
    (combine group) while chunk k's expert backward runs, and chunk k's input gradients return
    on the dispatch group. With `x_TD` (the re-communicating strategies) chunk k+1's input is
    re-dispatched alongside. `compute(k, layout, g_loc, x_loc or None)` runs the chunk's expert
    backward (accumulating weight gradients itself) and returns its input gradients (expert-
    major rows) or None; returns dx_TD (None when not needed)."""
    lays, groups = spec.layouts, spec.groups

    def send_grad(k):
        spec.note("output grads", k)
        return start_all_to_all(gy_RD.index_select(0, lays[k].row_idx), lays[k].send_splits,
                                lays[k].recv_splits, groups.ep_combine_group,
                                "pipelined backward (output grads)")

    disp = _Dispatcher(x_TD, spec, reuse=True) if x_TD is not None else None
    pend_g = send_grad(0)
    pend_x = disp.start(0, "pipelined backward (re-dispatch)") if disp else None
    dx_TD, back = None, None
    for k, lay in enumerate(lays):
        g_loc = _reorder(pend_g.wait(), lay.perm)
        if k + 1 < len(lays):
            pend_g = send_grad(k + 1)
        x_loc = None
        if disp is not None:
            x_loc = _reorder(pend_x.wait(), lay.perm)
            if k + 1 < len(lays):
                pend_x = disp.start(k + 1, "pipelined backward (re-dispatch)")
        spec.note("experts backward", k)
        dx_loc = compute(k, lay, g_loc, x_loc)
        del g_loc, x_loc
        if need_dx:
            spec.note("input grads", k)
            ret = start_all_to_all(_reorder(dx_loc.to(gy_RD.dtype), lay.inv_perm),
                                   lay.recv_splits, lay.send_splits, groups.ep_group,
                                   "pipelined backward (input grads)")
            del dx_loc
            if back is not None:
                dx_TD = _add_rows(dx_TD, lays[back[0]].token_idx, back[1].wait(), num_tokens)
            back = (k, ret)
    if back is not None:
        dx_TD = _add_rows(dx_TD, lays[back[0]].token_idx, back[1].wait(), num_tokens)
    return dx_TD


class PipelinedAllToAll(torch.autograd.Function):
    """y_RD (plan row order) = experts(x_TD[token of each row]) on the rows' owner ranks."""

    @staticmethod
    def forward(ctx, x_TD, spec: PipelineSpec, act, w1, w2, w3, b1, b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        di_mode, h_mode = STRATEGIES[spec.strategy]
        kept_x, kept_h = [], []

        def compute(k, lay, x_loc):
            y_loc, h1, h3 = ffn_forward(x_loc, lay.local_counts, w, act)
            if di_mode == "keep":
                kept_x.append(x_loc)
            elif di_mode == "offload":
                kept_x.append(_offload(x_loc))
            if h_mode == "keep":
                kept_h.append((h1, h3))
            elif h_mode == "offload":
                kept_h.append((_offload(h1), _offload(h3)))
            return y_loc

        with torch.autocast(x_TD.device.type, enabled=False):
            disp = _Dispatcher(x_TD, spec, reuse=spec.strategy != "none")
            y_RD = x_TD.new_empty(spec.num_rows, w2.shape[2])
            forward_chunks(spec, disp, y_RD, compute)
        host_bytes = 0
        for x_off in kept_x if di_mode == "offload" else ():
            host_bytes += x_off.numel() * x_off.element_size()
        for pair in kept_h if h_mode == "offload" else ():
            host_bytes += sum(t.numel() * t.element_size() for t in pair if t is not None)
        spec.stats["offloaded_bytes"] = host_bytes
        ctx.spec, ctx.act, ctx.num_tokens = spec, act, x_TD.shape[0]
        ctx.host_x = kept_x if di_mode == "offload" else None
        ctx.host_h = kept_h if h_mode == "offload" else None
        device_x = kept_x if di_mode == "keep" else []
        device_h = [t for pair in kept_h for t in pair if t is not None] if h_mode == "keep" \
            else []
        ctx.num_device_x = len(device_x)
        ctx.save_for_backward(x_TD if di_mode == "recomm" else None, w1, w2, w3, b1, b2,
                              *device_x, *device_h)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        spec, act = ctx.spec, ctx.act
        x_TD, w1, w2, w3, b1, b2, *rest = ctx.saved_tensors
        w = FFNWeights(w1, w2, w3, b1, b2)
        di_mode, h_mode = STRATEGIES[spec.strategy]
        device_x, device_h = rest[:ctx.num_device_x], rest[ctx.num_device_x:]
        need_dx, w_needs = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        need_dw = any(w_needs)
        gy_RD = gy_RD.contiguous()
        device = gy_RD.device
        start = _mark(gy_RD)
        grads = None

        def compute(k, lay, g_loc, x_loc):
            nonlocal grads
            if di_mode == "keep":
                x_loc = device_x[k]
            elif di_mode == "offload":
                x_loc = _reload(ctx.host_x[k], device)
            if h_mode == "keep":
                h_per = 2 if w3 is not None else 1
                h1, h3 = device_h[k * h_per], device_h[k * h_per + 1] if h_per == 2 else None
            elif h_mode == "offload":
                h1, h3 = (_reload(t, device) for t in ctx.host_h[k])
            else:
                h1, h3 = _hidden(x_loc, lay.local_counts, w)
            dx_loc, gw, _ = ffn_backward(g_loc, x_loc, h1, h3, lay.local_counts, w, act,
                                         need_dx=need_dx, need_dw=need_dw)
            if need_dw:
                parts = (gw.w1_EDF, gw.w2_EFD, gw.w3_EDF, gw.b1_EF, gw.b2_ED)
                grads = list(parts) if grads is None else \
                    [None if a is None else a.add_(b) for a, b in zip(grads, parts)]
            return dx_loc

        with torch.autocast(device.type, enabled=False):
            dx_TD = backward_chunks(spec, gy_RD, x_TD if di_mode == "recomm" else None,
                                    compute, need_dx, ctx.num_tokens)
        spec.stats["backward_marks"] = (start, _mark(gy_RD))
        out_w = [None] * 5
        if need_dw:
            out_w = [None if g is None or not need else g.mul_(spec.grad_scale)
                     for g, need in zip(grads, w_needs)]
        return (dx_TD, None, None, *out_w)


def run_grouped_pipeline(x_TD: torch.Tensor, spec: PipelineSpec,
                         local: GroupedExperts) -> torch.Tensor:
    """`PipelinedAllToAll` over the local grouped experts: y_RD in the plan's row order."""
    w = local.weights(x_TD.dtype)
    return PipelinedAllToAll.apply(x_TD.contiguous(), spec, local.act, w.w1_EDF, w.w2_EFD,
                                   w.w3_EDF, w.b1_EF, w.b2_ED)


def _add_rows(dx_TD, token_idx, rows_RD, num_tokens):
    if dx_TD is None:
        dx_TD = rows_RD.new_zeros(num_tokens, rows_RD.shape[1])
    return dx_TD.index_add_(0, token_idx, rows_RD)


class PipelinedExpertParallelDispatcher(ExpertParallelDispatcher):
    """Static EP through `PipelinedAllToAll` with `num_chunks` chunks (an int, or "auto" for the
    online tuner) and reuse `strategy`.

    Grouped experts run the grouped FFN kernels per chunk (all strategies); other expert modules
    go through `PipelinedModuleAllToAll` (strategies none, S2, S4). The counts exchange also
    carries each rank's row count and its last measured forward+backward time, so the tuner
    sees the same numbers on every rank.
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, *,
                 num_chunks: int | str = 2, strategy: str = "none",
                 tuner: TunerConfig | None = None, memory_limit_bytes: float | None = None,
                 rates: Rates | None = None) -> None:
        super().__init__(groups, num_experts)
        if num_chunks != "auto" and (not isinstance(num_chunks, int) or num_chunks < 1):
            raise ValueError(f"num_chunks={num_chunks!r} must be a positive integer or 'auto'")
        if strategy != "auto" and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; use 'auto' or one of "
                             f"{', '.join(STRATEGIES)}")
        self.num_chunks, self.strategy = num_chunks, strategy
        self.memory_limit_bytes, self.rates = memory_limit_bytes, rates
        self.tuner = ChunkTuner(tuner or TunerConfig()) if num_chunks == "auto" else None
        self.last_stats: dict = {}
        # (bucket, chunks) of the last calls (bounded: a long run makes millions of calls)
        self.history: deque[tuple[int, int]] = deque(maxlen=4096)

    def strategy_for(self, max_rows: int, chunks: int, local: GroupedExperts,
                     x_TD: torch.Tensor) -> str:
        """The reuse strategy of this call: fixed, or the cost model's pick (identical on every
        rank: measured rates are maxed over the group and max_rows is the group's maximum)."""
        if self.strategy != "auto":
            return self.strategy
        if self.rates is None:
            self.rates = measure_rates(self.groups, d_model=local.d_model, d_ff=local.d_ff,
                                       rows=max(64, max_rows), device=x_TD.device,
                                       dtype=x_TD.dtype)
        shape = LayerShape(rows=max_rows, d_model=local.d_model, d_ff=local.d_ff,
                           glu=local.glu, elem_bytes=x_TD.element_size(),
                           ep_size=self.groups.ep_size)
        return choose_strategy(shape, self.rates, chunks, self.memory_limit_bytes)[0]

    def spec(self, plan: RoutingPlan, send_WL, recv_WL, chunks: int,
             strategy: str) -> PipelineSpec:
        """The chunk layouts and settings of one call (send/recv counts from `_exchange`)."""
        layouts = chunk_layouts(send_WL, recv_WL, plan.token_idx_R, chunks, self.groups.ep_rank)
        return PipelineSpec(layouts=layouts, groups=self.groups, strategy=strategy,
                            num_rows=plan.num_rows, grad_scale=1.0 / self.groups.ep_size)

    def _exchange(self, plan: RoutingPlan, device):
        """Counts exchange carrying [counts of the peer's experts..., my rows, my last time]."""
        if len(plan.counts) != self.num_experts:
            raise ValueError(f"the routing plan has {len(plan.counts)} experts but the "
                             f"dispatcher was built for num_experts={self.num_experts}")
        W, L = self.groups.ep_size, self.num_local
        prev = self.last_stats
        elapsed_us = -1
        if "backward_marks" in prev and "forward_marks" in prev:
            fwd = _elapsed(*prev["forward_marks"])
            bwd = _elapsed(*prev["backward_marks"])
            if fwd is not None and bwd is not None:
                prev["forward_s"], prev["backward_s"] = fwd, bwd
                elapsed_us = int(1e6 * (fwd + bwd))
        send = [list(plan.counts[p * L:(p + 1) * L]) + [plan.num_rows, elapsed_us]
                for p in range(W)]
        recv = exchange_counts(torch.tensor(send, dtype=torch.int64, device=device),
                               self.groups.ep_group).tolist()
        times = [row[L + 1] for row in recv]
        if self.tuner is not None and prev and min(times) >= 0:
            self.tuner.record(prev["bucket"], prev["chunks"], max(times) / 1e6)
        max_rows = max(row[L] for row in recv)
        return [row[:L] for row in send], [row[:L] for row in recv], max_rows

    def __call__(self, x_TD: torch.Tensor, plan: RoutingPlan, experts) -> torch.Tensor:
        local = getattr(experts, "local", None)
        if not hasattr(local, "forward_rows"):
            raise ValueError("the pipelined expert-parallel dispatcher needs an ExpertShard "
                             f"(see shard_moe / expert_parallel_moe), got {type(experts).__name__}")
        if experts.num_local_experts != self.num_local:
            raise ValueError(f"the layer's experts hold {experts.num_local_experts} experts on "
                             f"this rank but the dispatcher expects {self.num_local}")
        grouped = isinstance(local, GroupedExperts)
        if not grouped and self.strategy == "auto":
            raise ValueError("strategy='auto' needs grouped experts (the cost model reads their "
                             "FFN shape); give module experts strategy none, S2 or S4")
        start = _mark(x_TD)
        send_WL, recv_WL, max_rows = self._exchange(plan, x_TD.device)
        bucket = bucket_of(max_rows)
        chunks = self.tuner.choose(bucket) if self.tuner is not None else self.num_chunks
        self.history.append((bucket, chunks))
        x_TD = x_TD.to(compute_dtype(x_TD))
        strategy = self.strategy_for(max_rows, chunks, local, x_TD)
        spec = self.spec(plan, send_WL, recv_WL, chunks, strategy)
        spec.stats.update(bucket=bucket, chunks=chunks, strategy=strategy)
        self.last_stats = spec.stats
        if grouped:
            y_RD = run_grouped_pipeline(x_TD, spec, local)
        else:
            from moescale.parallel.pipeline_modules import PipelinedModuleAllToAll
            y_RD = PipelinedModuleAllToAll.apply(x_TD.contiguous(), spec, local,
                                                 *local.parameters())
        spec.stats["forward_marks"] = (start, _mark(x_TD))
        return combine_rows(y_RD, plan)


def _mark(t: torch.Tensor):
    """A point in time without a host sync: perf_counter on CPU, a recorded event on CUDA."""
    if t.is_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(start, stop) -> float | None:
    """Seconds between two marks; None while a CUDA event has not completed (never waits).

    The tuner reads the previous call's marks during the next call, after the routing plan's
    host sync, so on CUDA they have completed by then."""
    if isinstance(start, float):
        return stop - start
    if not stop.query():
        return None
    return start.elapsed_time(stop) / 1e3
