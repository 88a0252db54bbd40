"""Autograd all-to-all with uneven splits, its async form, and the counts exchange.

`all_to_all_rows(x_RD, send_splits, recv_splits, group)` sends `send_splits[p]` consecutive rows
to peer p and receives `recv_splits[p]` rows from peer p (in peer order). Its backward is the
same exchange with the splits swapped, times an optional `grad_scale` (the expert-parallel
dispatcher uses it to keep expert gradients at the global-mean scale; see
docs/expert_parallel.md). `all_to_all_rows_async` returns the output at once with a handle to
wait on before reading it. `start_all_to_all` is the plain (no autograd) async exchange the
pipelined Function drives by hand. `exchange_counts` swaps per-(peer, expert) row counts with
one small all-to-all and one host sync.

Every collective here runs under `collective_errors`, which turns a backend failure (a dead
peer, a process-group timeout) into a RuntimeError that names the operation, the rank and the
likely cause.

It does not choose splits, pad, or reorder rows: callers own the layout.

Legend: R rows sent, S rows received, D row width, W group size, L experts per rank.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist


@contextlib.contextmanager
def collective_errors(what: str, group: dist.ProcessGroup | None):
    """Re-raise backend errors of a collective with context (which op, which rank, why)."""
    try:
        yield
    except RuntimeError as exc:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        raise RuntimeError(
            f"expert-parallel {what} failed on rank {rank} of a group of {size}: a peer rank "
            f"probably died, or did not reach the same collective within the process-group "
            f"timeout (ranks must call the MoE layers in the same order). Backend error: {exc}"
        ) from exc


def broadcast_outcome(outcome: tuple[str, object], src: int, group, what: str):
    """Rank `src`'s ("ok", value) or ("error", message) on every rank of `group`: returns the
    value, or raises ValueError(message) on every rank together (a set-up step that only the
    source performs fails everywhere, not just there)."""
    box = [outcome]
    with collective_errors(what, group):
        dist.broadcast_object_list(box, src=src, group=group)
    status, value = box[0]
    if status != "ok":
        raise ValueError(value)
    return value


def _check_splits(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                  group) -> None:
    size = dist.get_world_size(group)
    if len(send_splits) != size or len(recv_splits) != size:
        raise ValueError(f"all-to-all needs one split per rank of the group ({size}); got "
                         f"{len(send_splits)} send and {len(recv_splits)} recv splits")
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"send_splits sum to {sum(send_splits)} but the input has "
                         f"{x.shape[0]} rows; the splits must cover the rows exactly")


class PendingAllToAll:
    """An all-to-all in flight: `wait()` returns the received rows."""

    def __init__(self, out: torch.Tensor, work, group, what: str) -> None:
        self.out, self.work, self.group, self.what = out, work, group, what

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with collective_errors(self.what, self.group):
                self.work.wait()
            self.work = None
        return self.out


def start_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                     group=None, what: str = "all-to-all", out: torch.Tensor | None = None
                     ) -> PendingAllToAll:
    """Launch an uneven all-to-all of rows (no autograd); `.wait()` gives the result.

    `out` may be a preallocated [sum(recv_splits), ...] buffer (the pipeline reuses buffers).
    """
    _check_splits(x, send_splits, recv_splits, group)
    if out is None:
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    with collective_errors(what, group):
        work = dist.all_to_all_single(out, x.contiguous(), list(recv_splits),
                                      list(send_splits), group=group, async_op=True)
    return PendingAllToAll(out, work, group, what)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, send_splits, recv_splits, group, grad_scale, box):
        ctx.splits, ctx.group, ctx.grad_scale = (send_splits, recv_splits), group, grad_scale
        pending = start_all_to_all(x_RD, send_splits, recv_splits, group)
        if box is None:
            return pending.wait()
        box.append(pending)
        return pending.out

    @staticmethod
    def backward(ctx, gy_SD):
        send_splits, recv_splits = ctx.splits
        gx_RD = start_all_to_all(gy_SD.contiguous(), recv_splits, send_splits, ctx.group,
                                 what="all-to-all backward").wait()
        if ctx.grad_scale != 1.0:
            gx_RD = gx_RD * ctx.grad_scale
        return gx_RD, None, None, None, None, None


def all_to_all_rows(x_RD: torch.Tensor, send_splits: Sequence[int],
                    recv_splits: Sequence[int], group=None, grad_scale: float = 1.0
                    ) -> torch.Tensor:
    """Differentiable uneven all-to-all; backward swaps the splits and multiplies by grad_scale."""
    return _AllToAllRows.apply(x_RD, tuple(send_splits), tuple(recv_splits), group,
                               float(grad_scale), None)


def all_to_all_rows_async(x_RD: torch.Tensor, send_splits: Sequence[int],
                          recv_splits: Sequence[int], group=None, grad_scale: float = 1.0
                          ) -> tuple[torch.Tensor, PendingAllToAll]:
    """Like `all_to_all_rows` but returns (out, handle) at once: call `handle.wait()` before
    reading `out`. The backward exchange is synchronous."""
    box: list[PendingAllToAll] = []
    out = _AllToAllRows.apply(x_RD, tuple(send_splits), tuple(recv_splits), group,
                              float(grad_scale), box)
    return out, box[0]


def exchange_counts(send_counts_WL: torch.Tensor, group=None) -> torch.Tensor:
    """recv_counts_WL[p, l] = rows peer p sends to this rank's local expert l.

    `send_counts_WL[p, l]` are the rows this rank sends to peer p's local expert l. One
    all-to-all of W*L integers; no host sync here (the caller reads the result once).
    """
    size = dist.get_world_size(group)
    if send_counts_WL.dim() != 2 or send_counts_WL.shape[0] != size:
        raise ValueError(f"send_counts_WL has shape {tuple(send_counts_WL.shape)}; it must be "
                         f"[group size {size}, experts per rank]")
    flat = send_counts_WL.reshape(-1).contiguous()
    out = torch.empty_like(flat)
    with collective_errors("counts exchange", group):
        dist.all_to_all_single(out, flat, group=group)
    return out.view(size, -1)


class _AllReduceSum(torch.autograd.Function):
    """y = sum over the group of x on every rank; dL/dx_r = sum over ranks of dL_q/dy_q."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        with collective_errors("all-reduce", group):
            dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, gy):
        gx = gy.clone()
        with collective_errors("all-reduce backward", ctx.group):
            dist.all_reduce(gx, group=ctx.group)
        return gx, None


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-reduce (sum)."""
    return _AllReduceSum.apply(x, group)
