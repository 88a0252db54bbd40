"""The autograd Functions over the grouped expert kernels (moescale.layers.grouped_ffn).

`GroupedFFNRows`: y_RD = ffn_e(x_RD) on rows already grouped by expert (the seam the
all-to-all and offloading dispatchers call through `GroupedExperts.forward_rows`); saves x_RD
and the pre-activation hidden(s).

`GroupedFFNRouted`: the local fast path that fuses gather, experts, score weighting and combine.
Each chunk gathers its token rows with `index_select`; the weighted rows are summed back per
token by gathering them through the inverse map `inv_JT` (several times faster on CPU than a
scattering `index_add_`, and deterministic). It saves `x_TD` (T rows) instead of `x_RD` (T*K
rows), never the expert output, and never materialises `x_RD`: the score gradient is
<g_r, y_r> = <g_r W2^T, a_r> (+ <g_r, b2>), a row dot of tensors backward has anyway.

The math (blocks, buffers, low precision) lives in grouped_ffn.py; this file only wires it into
autograd.

Legend: R rows, T tokens, J rows per token (top-k), D model width, F hidden width.
"""

from __future__ import annotations

import torch

from moescale.layers.grouped_ffn import (FFNWeights, ffn_backward, ffn_backward_blocks,
                                         ffn_forward, ffn_forward_blocks, work_dtype)
from moescale.layers.page_release import hidden_pointer, releasable


def _weights_from(args) -> FFNWeights:
    return FFNWeights(*args)


def _release(ctx, h1_RF, h3_RF) -> bool:
    """Whether backward may hand the saved hidden's pages back block by block (page_release):
    both hiddens (h3 for GLU) must qualify."""
    p1, p3 = ctx.hidden_ptrs
    return releasable(h1_RF, p1) and (h3_RF is None or releasable(h3_RF, p3))


def _grads_tuple(gw: FFNWeights, ctx_needs) -> tuple:
    grads = (gw.w1_EDF, gw.w2_EFD, gw.w3_EDF, gw.b1_EF, gw.b2_ED)
    return tuple(g if need else None for g, need in zip(grads, ctx_needs))


class GroupedFFNRows(torch.autograd.Function):
    """y_RD = ffn_e(x_RD) on rows grouped by expert (the seam for all-to-all and offloading)."""

    @staticmethod
    def forward(ctx, x_RD, counts, act, grad_buffers, w1, w2, w3, b1, b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        with torch.autocast(x_RD.device.type, enabled=False):
            y_RD, h1_RF, h3_RF = ffn_forward(x_RD, counts, w, act)
        ctx.counts, ctx.act, ctx.grad_buffers = counts, act, grad_buffers
        ctx.hidden_ptrs = (hidden_pointer(h1_RF), hidden_pointer(h3_RF))
        ctx.save_for_backward(x_RD, h1_RF, h3_RF, w1, w2, w3, b1, b2)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        x_RD, h1_RF, h3_RF, *wts = ctx.saved_tensors
        w_needs = ctx.needs_input_grad[4:]
        with torch.autocast(x_RD.device.type, enabled=False):
            dx_RD, gw, _ = ffn_backward(gy_RD.contiguous(), x_RD, h1_RF, h3_RF, ctx.counts,
                                        _weights_from(wts), ctx.act,
                                        need_dx=ctx.needs_input_grad[0], need_dw=any(w_needs),
                                        release_hidden=_release(ctx, h1_RF, h3_RF),
                                        grad_buffers=ctx.grad_buffers)
        return (dx_RD, None, None, None) + _grads_tuple(gw, w_needs)


def token_slots(token_idx_R: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """inv_JT[j, t]: the j-th row of token t, or R (a zero row) where t has fewer rows.

    Combining rows by gathering them back per token is several times faster on CPU than
    `index_add_` (a scatter), and deterministic everywhere.
    """
    num_rows = token_idx_R.shape[0]
    per_T = torch.bincount(token_idx_R, minlength=num_tokens)
    num_slots = int(per_T.max()) if num_rows else 0
    order_R = torch.argsort(token_idx_R, stable=True)
    tok_R = token_idx_R[order_R]
    slot_R = torch.arange(num_rows, device=token_idx_R.device) - (per_T.cumsum(0) - per_T)[tok_R]
    inv_JT = torch.full((num_slots, num_tokens), num_rows, dtype=torch.long,
                        device=token_idx_R.device)
    inv_JT[slot_R, tok_R] = order_R
    return inv_JT


def gather_sum(rows_XD: torch.Tensor, inv_JT: torch.Tensor) -> torch.Tensor:
    """out_TD = sum_j rows_XD[inv_JT[j]] (rows_XD's last row is the zero row).

    fp32 rows on a CPU take one `embedding_bag` sum (one pass, no T x D temporary: 6 ms
    instead of 14 ms at T = 8192, D = 512, J = 2 on a 2-core EPYC, bitwise equal for J = 2);
    other dtypes gather and add (bf16's `embedding_bag` is 2x faster too, but its sum is off
    by up to 1 ulp, where adding two bf16 rows rounds the exact sum once)."""
    num_slots, num_tokens = inv_JT.shape
    if num_slots == 0:
        return rows_XD.new_zeros(num_tokens, rows_XD.shape[1])
    if rows_XD.dtype == torch.float32 and rows_XD.device.type == "cpu":
        offsets_T = torch.arange(0, num_slots * num_tokens, num_slots, device=inv_JT.device)
        return torch.nn.functional.embedding_bag(inv_JT.t().reshape(-1), rows_XD, offsets_T,
                                                 mode="sum")
    out_TD = rows_XD.index_select(0, inv_JT[0])
    for j in range(1, num_slots):
        out_TD += rows_XD.index_select(0, inv_JT[j])
    return out_TD


def rows_with_zero(num_rows: int, width: int, like: torch.Tensor, dtype) -> torch.Tensor:
    """A rows buffer with one extra zero row at the end (for tokens with fewer rows)."""
    buf = like.new_empty(num_rows + 1, width, dtype=dtype)
    buf[num_rows].zero_()
    return buf


class GroupedFFNRouted(torch.autograd.Function):
    """y_TD = sum over rows r of token t: scores_r * ffn_e(x_TD[t]): gather, experts, combine."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, token_idx_R, counts, act, grad_buffers, w1, w2, w3, b1,
                b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        work = work_dtype(x_TD)
        num_rows = token_idx_R.shape[0]
        with torch.autocast(x_TD.device.type, enabled=False):
            inv_JT = token_slots(token_idx_R, x_TD.shape[0])
            y_XD = rows_with_zero(num_rows, w2.shape[2], x_TD, work)

            def y_done(s, t, y_ND):
                y_ND.mul_(scores_R[s:t].to(work).unsqueeze(1))

            h1_RF, h3_RF = ffn_forward_blocks(
                num_rows, counts, w, act,
                x_rows=lambda s, t: x_TD.index_select(0, token_idx_R[s:t]).to(work),
                y_dest=lambda s, t, n, y_XD=y_XD: y_XD[s:t], y_done=y_done, like=x_TD)
            y_TD = gather_sum(y_XD, inv_JT).to(x_TD.dtype)
            del y_XD
        ctx.counts, ctx.act, ctx.grad_buffers = counts, act, grad_buffers
        ctx.hidden_ptrs = (hidden_pointer(h1_RF), hidden_pointer(h3_RF))
        ctx.save_for_backward(x_TD, scores_R, token_idx_R, inv_JT, h1_RF, h3_RF,
                              w1, w2, w3, b1, b2)
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        x_TD, scores_R, token_idx_R, inv_JT, h1_RF, h3_RF, *wts = ctx.saved_tensors
        w_needs = ctx.needs_input_grad[6:]
        need_dx = ctx.needs_input_grad[0]
        work = work_dtype(x_TD)
        num_rows = token_idx_R.shape[0]
        with torch.autocast(x_TD.device.type, enabled=False):
            gy_TD = gy_TD.contiguous()
            dx_XD = rows_with_zero(num_rows, x_TD.shape[1], x_TD, work) if need_dx else None
            gw, dscale_R = ffn_backward_blocks(
                ctx.counts, _weights_from(wts), ctx.act, h1_RF, h3_RF,
                x_rows=lambda s, t: x_TD.index_select(0, token_idx_R[s:t]).to(work),
                gy_rows=lambda s, t: gy_TD.index_select(0, token_idx_R[s:t]).to(work),
                dx_dest=(lambda s, t, n: dx_XD[s:t]) if need_dx else None, dx_done=None,
                scale_R=scores_R, need_dw=any(w_needs),
                release_hidden=_release(ctx, h1_RF, h3_RF), grad_buffers=ctx.grad_buffers)
            dx_TD = gather_sum(dx_XD, inv_JT).to(x_TD.dtype) if need_dx else None
        dscale_R = dscale_R.to(scores_R.dtype) if ctx.needs_input_grad[1] else None
        return (dx_TD, dscale_R, None, None, None, None) + _grads_tuple(gw, w_needs)
