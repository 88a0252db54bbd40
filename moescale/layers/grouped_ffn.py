"""Grouped expert FFN kernels: one GEMM per non-empty expert, hand-written backward.

Rows arrive grouped by expert (`counts[e]` consecutive rows each). Forward writes every
expert's GEMM straight into slices of one output buffer; backward writes each expert's weight
gradient straight into its slice of one stacked gradient. Nothing indexes a stacked weight
inside autograd, so no expert pays a zero-filled full-size gradient.

Saved for backward: the layer input and the pre-activation hidden (both GLU halves for GLU);
the activation is recomputed. `GroupedFFNRouted` also fuses gather, score weighting and combine,
so it saves `x_TD` (T rows) instead of `x_RD` (T*K rows) and never the expert output: the score
gradient is <g_r, y_r> = <g_r W2^T, a_r> (+ <g_r, b2>), formed from tensors backward has anyway.

Low precision on CPUs without native bf16/fp16 GEMMs (AVX2 machines run torch's bf16 GEMM
~150x slower than fp32) computes each GEMM in fp32 from the low-precision operands and rounds
the result: same inputs, same output precision, fp32 accumulation as on accelerators.

Legend: R rows, T tokens, D model width, F expert hidden width, E experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moescale.layers.activations import Activation


@functools.cache
def _cpu_lacks_fast_lowp(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def needs_fp32_gemm(t: torch.Tensor) -> bool:
    """True when a GEMM on `t` should run in fp32 (low precision on a CPU without support)."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) and \
        _cpu_lacks_fast_lowp(t.dtype)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            bias: torch.Tensor | None = None) -> None:
    """out = a @ b (+ bias), in place, in the fastest exact way for the precision."""
    if needs_fp32_gemm(a):
        result = torch.mm(a.float(), b.float())
        if bias is not None:
            result += bias.float()
        out.copy_(result)
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def segments(counts: list[int] | tuple[int, ...]):
    """Yield (expert, start, stop) for each expert with at least one row."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


@dataclass
class FFNWeights:
    """Stacked expert weights in compute precision; w3 is the GLU gate (None for plain FFN)."""

    w1_EDF: torch.Tensor
    w2_EFD: torch.Tensor
    w3_EDF: torch.Tensor | None = None
    b1_EF: torch.Tensor | None = None
    b2_ED: torch.Tensor | None = None


def ffn_forward(x_RD: torch.Tensor, counts, w: FFNWeights, act: Activation):
    """Returns (y_RD, h1_RF, h3_RF or None)."""
    num_rows, hidden = x_RD.shape[0], w.w1_EDF.shape[2]
    h1_RF = x_RD.new_empty(num_rows, hidden)
    h3_RF = x_RD.new_empty(num_rows, hidden) if w.w3_EDF is not None else None
    for e, s, t in segments(counts):
        mm_into(h1_RF[s:t], x_RD[s:t], w.w1_EDF[e], None if w.b1_EF is None else w.b1_EF[e])
        if h3_RF is not None:
            mm_into(h3_RF[s:t], x_RD[s:t], w.w3_EDF[e])
    a_RF = act.forward(h1_RF)
    if h3_RF is not None:
        a_RF = a_RF * h3_RF
    y_RD = x_RD.new_empty(num_rows, w.w2_EFD.shape[2])
    for e, s, t in segments(counts):
        mm_into(y_RD[s:t], a_RF[s:t], w.w2_EFD[e], None if w.b2_ED is None else w.b2_ED[e])
    return y_RD, h1_RF, h3_RF


def _empty_grad(param: torch.Tensor | None, counts, wanted: bool):
    """A stacked gradient buffer whose empty-expert slices are zero (the others get written)."""
    if param is None or not wanted:
        return None
    grad = torch.empty_like(param)
    for e, n in enumerate(counts):
        if n == 0:
            grad[e].zero_()
    return grad


def ffn_backward(gy_RD, x_RD, h1_RF, h3_RF, counts, w: FFNWeights, act: Activation,
                 scale_R: torch.Tensor | None = None, need_dx: bool = True,
                 need_dw: bool = True):
    """Gradients of y_r = scale_r * ffn_e(x_r) given gy_RD = dL/d(scaled y) (unscaled rows).

    Returns (dx_RD, FFNWeights of grads (entries None when not wanted), dscale_R or None).
    """
    a1_RF = act.forward(h1_RF)
    a_RF = a1_RF * h3_RF if h3_RF is not None else a1_RF
    ga_RF = torch.empty_like(h1_RF)
    for e, s, t in segments(counts):
        mm_into(ga_RF[s:t], gy_RD[s:t], w.w2_EFD[e].t())
    dscale_R = None
    if scale_R is not None:
        dscale_R = (ga_RF * a_RF).sum(-1, dtype=torch.float32).to(scale_R.dtype)
        if w.b2_ED is not None:
            for e, s, t in segments(counts):
                dscale_R[s:t] += (gy_RD[s:t].float() @ w.b2_ED[e].float())
        scale_R1 = scale_R.to(gy_RD.dtype).unsqueeze(1)
        gy_RD = gy_RD * scale_R1
        ga_RF.mul_(scale_R1)
    gw = FFNWeights(
        w1_EDF=_empty_grad(w.w1_EDF, counts, need_dw), w2_EFD=_empty_grad(w.w2_EFD, counts, need_dw),
        w3_EDF=_empty_grad(w.w3_EDF, counts, need_dw), b1_EF=_empty_grad(w.b1_EF, counts, need_dw),
        b2_ED=_empty_grad(w.b2_ED, counts, need_dw))
    if need_dw:
        for e, s, t in segments(counts):
            mm_into(gw.w2_EFD[e], a_RF[s:t].t(), gy_RD[s:t])
            if gw.b2_ED is not None:
                gw.b2_ED[e] = gy_RD[s:t].sum(0)
    del a_RF
    if h3_RF is not None:
        dh3_RF = ga_RF * a1_RF
        dh1_RF = act.backward(ga_RF.mul_(h3_RF), h1_RF)
    else:
        dh3_RF = None
        dh1_RF = act.backward(ga_RF, h1_RF)
    del ga_RF, a1_RF
    dx_RD = x_RD.new_empty(x_RD.shape) if need_dx else None
    for e, s, t in segments(counts):
        if need_dw:
            mm_into(gw.w1_EDF[e], x_RD[s:t].t(), dh1_RF[s:t])
            if gw.b1_EF is not None:
                gw.b1_EF[e] = dh1_RF[s:t].sum(0)
            if dh3_RF is not None:
                mm_into(gw.w3_EDF[e], x_RD[s:t].t(), dh3_RF[s:t])
        if need_dx:
            mm_into(dx_RD[s:t], dh1_RF[s:t], w.w1_EDF[e].t())
            if dh3_RF is not None:
                dx_RD[s:t] += _mm(dh3_RF[s:t], w.w3_EDF[e].t())
    return dx_RD, gw, dscale_R


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty(a.shape[0], b.shape[1])
    mm_into(out, a, b)
    return out


def _weights_from(args) -> FFNWeights:
    return FFNWeights(*args)


def _grads_tuple(gw: FFNWeights, ctx_needs) -> tuple:
    grads = (gw.w1_EDF, gw.w2_EFD, gw.w3_EDF, gw.b1_EF, gw.b2_ED)
    return tuple(g if need else None for g, need in zip(grads, ctx_needs))


class GroupedFFNRows(torch.autograd.Function):
    """y_RD = ffn_e(x_RD) on rows grouped by expert (the seam for all-to-all and offloading)."""

    @staticmethod
    def forward(ctx, x_RD, counts, act, w1, w2, w3, b1, b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        with torch.autocast(x_RD.device.type, enabled=False):
            y_RD, h1_RF, h3_RF = ffn_forward(x_RD, counts, w, act)
        ctx.counts, ctx.act = counts, act
        ctx.save_for_backward(x_RD, h1_RF, h3_RF, w1, w2, w3, b1, b2)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        x_RD, h1_RF, h3_RF, *wts = ctx.saved_tensors
        w_needs = ctx.needs_input_grad[3:]
        with torch.autocast(x_RD.device.type, enabled=False):
            dx_RD, gw, _ = ffn_backward(gy_RD.contiguous(), x_RD, h1_RF, h3_RF, ctx.counts,
                                        _weights_from(wts), ctx.act,
                                        need_dx=ctx.needs_input_grad[0], need_dw=any(w_needs))
        return (dx_RD, None, None) + _grads_tuple(gw, w_needs)


class GroupedFFNRouted(torch.autograd.Function):
    """y_TD = sum over rows r of token t: scores_r * ffn_e(x_TD[t]): gather, experts, combine."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, token_idx_R, counts, act, w1, w2, w3, b1, b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        with torch.autocast(x_TD.device.type, enabled=False):
            x_RD = x_TD.index_select(0, token_idx_R)
            y_RD, h1_RF, h3_RF = ffn_forward(x_RD, counts, w, act)
            del x_RD
            y_RD.mul_(scores_R.to(y_RD.dtype).unsqueeze(1))
            y_TD = y_RD.new_zeros(x_TD.shape[0], y_RD.shape[1]).index_add_(0, token_idx_R, y_RD)
        ctx.counts, ctx.act = counts, act
        ctx.save_for_backward(x_TD, scores_R, token_idx_R, h1_RF, h3_RF, w1, w2, w3, b1, b2)
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        x_TD, scores_R, token_idx_R, h1_RF, h3_RF, *wts = ctx.saved_tensors
        w_needs = ctx.needs_input_grad[5:]
        need_dx = ctx.needs_input_grad[0]
        with torch.autocast(x_TD.device.type, enabled=False):
            gy_RD = gy_TD.index_select(0, token_idx_R)
            x_RD = x_TD.index_select(0, token_idx_R)
            dx_RD, gw, dscale_R = ffn_backward(
                gy_RD, x_RD, h1_RF, h3_RF, ctx.counts, _weights_from(wts), ctx.act,
                scale_R=scores_R, need_dx=need_dx, need_dw=any(w_needs))
            dx_TD = None
            if need_dx:
                dx_TD = torch.zeros_like(x_TD).index_add_(0, token_idx_R, dx_RD)
        dscale_R = dscale_R if ctx.needs_input_grad[1] else None
        return (dx_TD, dscale_R, None, None, None) + _grads_tuple(gw, w_needs)
