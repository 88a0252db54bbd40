"""The chunk schedule of the pipelined all-to-all, shared by the grouped and the module pipelines.

Both directions fuse the combine (score weighting and the per-token sum) into the pipeline, so
no R-row output, output gradient or score product is ever materialised:

  forward   chunk k+1's dispatch is in flight (dispatch group) while chunk k's experts run;
            chunk k's outputs travel back on the combine group while chunk k+1 computes; on
            arrival they are weighted by their scores and added into y_TD at their tokens.
  backward  chunk k+1's output gradients (the token rows of gy_TD, unweighted) and scores
            travel on the combine group while chunk k's expert backward runs; chunk k's input
            gradients and score gradients return on the dispatch group and are added into
            dx_TD / written into dscores_R at once. With `x_TD` (the re-communicating
            strategies) chunk k+1's input is re-dispatched alongside.

Buffers (what lives per chunk, and for how long):

  - the rows a rank sends are gathered from x_TD / gy_TD when the exchange starts and dropped
    when it completes; the rows it gets back are consumed (added at their tokens) on arrival.
  - the owner side receives into `SlotRing`s when the strategy does not keep the received rows:
    the forward's dispatched input is overwritten in place by the chunk's outputs (the kernels
    read a block's rows before writing its outputs), the backward's output gradients in place by
    the input gradients. A forward slot is busy from the launch of the exchange that fills it
    until the return exchange that sends from it completes, i.e. over three chunks: three slots
    rotate. Backward uses three as well with `none`, two with a reuse strategy (see
    `backward_chunks`); re-dispatched inputs (S3/S4) rotate through two more.
  - nothing of chunk k stays alive after its return exchange completes unless the strategy
    keeps it (the caller's `compute` owns that decision).

`PipelineSpec` (here) is what the pipeline Functions read of one call besides tensors: the
chunk layouts (moescale.dispatch.chunk_layout), groups, strategy, gradient scale.

`mark` / `elapsed` time a call without a host sync (the tuner reads them one call later).

Callbacks: forward `compute(k, layout, x_SD) -> y_SD` (source-major rows, may be x_SD
itself); backward `compute(k, layout, g_SD, s_S, x_SD or None) -> (dx_SD or None,
ds_S or None)` (source-major; dx_SD may be g_SD itself).

Legend: T tokens, R rows sent (plan order; a chunk's share of them too), S rows received in one
chunk (source-major), D model width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moescale.dispatch.chunk_layout import ChunkLayout
from moescale.parallel.all_to_all import PendingAllToAll, start_all_to_all
from moescale.parallel.groups import ParallelGroups


@dataclass
class PipelineSpec:
    """Everything the pipeline Functions need besides tensors (host data and groups)."""

    layouts: list[ChunkLayout]
    groups: ParallelGroups
    strategy: str
    num_rows: int                      # R: rows of the plan on this rank
    grad_scale: float                  # multiplies expert weight gradients
    block_rows: int | None = None      # rows per expert GEMM block (None: pipeline_block_rows)
    stats: dict = field(default_factory=dict)   # filled in: buffer bytes, offloaded bytes
    trace: list | None = None          # if a list: (event, chunk) in issue order (for tests)

    def note(self, event: str, chunk: int) -> None:
        if self.trace is not None:
            self.trace.append((event, chunk))

    @property
    def max_recv(self) -> int:
        return max((lay.num_recv for lay in self.layouts), default=0)


class SlotRing:
    """`count` rotating [rows, width] receive buffers; chunk k gets a view of slot k mod count."""

    def __init__(self, count: int, rows: int, width: int, like: torch.Tensor) -> None:
        self.slots = [like.new_empty(rows, width) for _ in range(count)]

    def take(self, k: int, rows: int) -> torch.Tensor:
        return self.slots[k % len(self.slots)][:rows]

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)


def make_ring(spec: PipelineSpec, width: int, like: torch.Tensor, count: int = 3) -> SlotRing:
    return SlotRing(min(count, len(spec.layouts)), spec.max_recv, width, like)


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """An offloaded copy (pinned host memory); a CPU tensor is already in host memory and is
    kept as it is (callers copy out of reused slots themselves)."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t)


def to_device(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _scores(scores_R: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return scores_R.detach().index_select(0, lay.row_idx)


def forward_chunks(spec: PipelineSpec, x_TD: torch.Tensor, scores_R: torch.Tensor, compute,
                   ring: SlotRing | None) -> torch.Tensor:
    """y_TD = sum over the rows r of token t of scores_R[r] * experts(x_TD[t]) (see above)."""
    lays, groups = spec.layouts, spec.groups
    y_TD = x_TD.new_zeros(x_TD.shape)

    def dispatch(k: int) -> PendingAllToAll:
        spec.note("pipelined dispatch", k)
        lay = lays[k]
        out = None if ring is None else ring.take(k, lay.num_recv)
        return start_all_to_all(x_TD.index_select(0, lay.token_idx), lay.send_splits,
                                lay.recv_splits, groups.ep_group, "pipelined dispatch", out=out)

    def combine(k: int, pending: PendingAllToAll) -> None:
        y_rows_RD = pending.wait()
        y_rows_RD.mul_(_scores(scores_R, lays[k]).to(y_rows_RD.dtype).unsqueeze(1))
        y_TD.index_add_(0, lays[k].token_idx, y_rows_RD)

    pending, back = dispatch(0), None
    for k, lay in enumerate(lays):
        x_SD = pending.wait()
        if k + 1 < len(lays):
            pending = dispatch(k + 1)
        spec.note("experts forward", k)
        y_SD = compute(k, lay, x_SD)
        del x_SD
        spec.note("pipelined combine", k)
        ret = start_all_to_all(y_SD, lay.recv_splits, lay.send_splits,
                               groups.ep_combine_group, "pipelined combine")
        del y_SD
        if back is not None:
            combine(*back)
        back = (k, ret)
    combine(*back)
    return y_TD


def backward_chunks(spec: PipelineSpec, gy_TD: torch.Tensor, scores_R: torch.Tensor,
                    x_TD: torch.Tensor | None, compute, need_dx: bool, need_dscore: bool
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx_TD or None, dscores_R or None) of forward_chunks' output (see above).

    With a reuse strategy (anything but `none`) chunk k-1's returning input gradients are
    collected before chunk k+1's exchanges start ("lean" order): their slot is then free for
    chunk k+1, so two output-gradient slots suffice and no returning rows are alive while
    chunk k computes; the return exchange of chunk k-1 is then not overlapped with chunk k's
    experts. `none` keeps the fully overlapped order (three slots)."""
    lays, groups = spec.layouts, spec.groups
    lean = spec.strategy != "none"
    g_ring = make_ring(spec, gy_TD.shape[1], gy_TD, count=2 if lean else 3)
    x_ring = make_ring(spec, x_TD.shape[1], x_TD, count=2) if x_TD is not None else None
    spec.stats["backward_buffer_bytes"] = g_ring.nbytes + (x_ring.nbytes if x_ring else 0)
    out = {"dx": None, "ds": None}

    def send_grad(k: int):
        spec.note("output grads", k)
        lay = lays[k]
        g = start_all_to_all(gy_TD.index_select(0, lay.token_idx), lay.send_splits,
                             lay.recv_splits, groups.ep_combine_group,
                             "pipelined backward (output grads)", out=g_ring.take(k, lay.num_recv))
        s = start_all_to_all(_scores(scores_R, lay), lay.send_splits, lay.recv_splits,
                             groups.ep_combine_group, "pipelined backward (scores)")
        return g, s

    def redispatch(k: int) -> PendingAllToAll:
        spec.note("pipelined backward (re-dispatch)", k)
        lay = lays[k]
        return start_all_to_all(x_TD.index_select(0, lay.token_idx), lay.send_splits,
                                lay.recv_splits, groups.ep_group,
                                "pipelined backward (re-dispatch)",
                                out=x_ring.take(k, lay.num_recv))

    def collect(k: int, pend_dx, pend_ds) -> None:
        lay = lays[k]
        if pend_dx is not None:
            if out["dx"] is None:
                out["dx"] = gy_TD.new_zeros(gy_TD.shape)
            out["dx"].index_add_(0, lay.token_idx, pend_dx.wait())
        if pend_ds is not None:
            if out["ds"] is None:
                out["ds"] = scores_R.new_zeros(scores_R.shape)
            out["ds"].index_copy_(0, lay.row_idx, pend_ds.wait())

    pend_g = send_grad(0)
    pend_x = redispatch(0) if x_TD is not None else None
    back = None
    for k, lay in enumerate(lays):
        g_SD, s_S = pend_g[0].wait(), pend_g[1].wait()
        x_SD = None if pend_x is None else pend_x.wait()
        if lean and back is not None:
            collect(*back)
            back = None
        if k + 1 < len(lays):
            pend_g = send_grad(k + 1)
            pend_x = redispatch(k + 1) if x_TD is not None else None
        spec.note("experts backward", k)
        dx_SD, ds_S = compute(k, lay, g_SD, s_S, x_SD)
        del g_SD, s_S, x_SD
        ret_dx = ret_ds = None
        if need_dx:
            spec.note("input grads", k)
            ret_dx = start_all_to_all(dx_SD, lay.recv_splits, lay.send_splits,
                                      groups.ep_group, "pipelined backward (input grads)")
        if need_dscore:
            ret_ds = start_all_to_all(ds_S, lay.recv_splits, lay.send_splits,
                                      groups.ep_group, "pipelined backward (score grads)")
        del dx_SD, ds_S
        if back is not None:
            collect(*back)
        back = (k, ret_dx, ret_ds)
        del ret_dx, ret_ds        # `back` alone holds them: collected, they are dropped
    collect(*back)
    return out["dx"], out["ds"]


def mark(t: torch.Tensor):
    """A point in time without a host sync: perf_counter on CPU, a recorded event on CUDA."""
    if t.is_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed(start, stop) -> float | None:
    """Seconds between two marks; None while a CUDA event has not completed (never waits).

    The tuner reads the previous call's marks during the next call, after the routing plan's
    host sync, so on CUDA they have completed by then."""
    if isinstance(start, float):
        return stop - start
    if not stop.query():
        return None
    return start.elapsed_time(stop) / 1e3
