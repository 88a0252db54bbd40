"""`PipelinedAllToAll`: the pipelined expert-parallel exchange over grouped FFN/GLU experts.

One autograd Function covers dispatch, the local grouped experts, the return exchange and the
combine (y_TD = sum over a token's rows of score * expert output), with a hand-written,
hand-pipelined backward; the chunk schedule and its buffers are pipeline_schedule.py's.

Memory reuse (MPipeMoE's strategies). What backward needs of each chunk is the dispatched
input (DI) and the expert hidden (H):

  strategy   DI                                  H
  none       kept (the chunk's receive buffer)   kept
  S1         offloaded to host, reloaded         offloaded, reloaded
  S2         offloaded, reloaded                 recomputed (GEMM 1 re-run per block)
  S3         re-communicated (dispatch re-run)   offloaded, reloaded
  S4         re-communicated                     recomputed

What is kept is dropped chunk by chunk as backward consumes it. A hidden that is not kept
exists only as one block buffer of the kernels (forward and the recompute in backward); a DI
that is not kept on the device is received into rotating slots that the chunk's outputs then
overwrite in place. On a CPU, host memory is the device memory: "offloading" keeps the tensor
where it is (no copy), so S1 holds what `none` holds, S2 what `none` holds minus H, S3 minus DI.
Offloaded copies on an accelerator are synchronous (correct everywhere; overlapping them on a
side stream is not done yet).

Weight gradients are accumulated chunk by chunk into one stacked gradient per weight (the
kernels write each block's contribution into its expert's slice) and multiplied by
`spec.grad_scale` (1/W, as in `ExpertParallelDispatcher`) once; input gradients are not scaled.

Legend: T tokens, R rows sent (plan order), S rows received in one chunk, D model width,
F expert hidden width.
"""

from __future__ import annotations

import torch

from moescale.dispatch.chunk_layout import ChunkLayout
from moescale.layers.experts import GroupedExperts
from moescale.layers.grouped_ffn import (FFNWeights, ffn_backward_blocks, ffn_forward_blocks,
                                         work_dtype)
from moescale.parallel.cost_model import STRATEGIES
from moescale.parallel.memory_model import pipeline_block_rows
from moescale.parallel.pipeline_schedule import (PipelineSpec, backward_chunks, forward_chunks,
                                                 make_ring, mark, to_device, to_host)


def _row_reader(src: torch.Tensor, lay: ChunkLayout, work: torch.dtype):
    """rows(s, t): rows [s, t) of the chunk in expert-major order, read from `src` (received,
    source-major) through the chunk's permutation."""
    if lay.perm is None:
        return lambda s, t: src[s:t].to(work)
    perm = lay.perm
    return lambda s, t: src.index_select(0, perm[s:t]).to(work)


def _row_writer(dst: torch.Tensor, lay: ChunkLayout):
    """(dest, done) for the kernels: block outputs land in `dst` at their source-major rows."""
    if lay.perm is None:
        return (lambda s, t, n: dst[s:t]), None
    perm = lay.perm
    return ((lambda s, t, n: dst.new_empty(n, dst.shape[1])),
            (lambda s, t, out: dst.index_copy_(0, perm[s:t], out)))


def _source_order(v_S: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return v_S if lay.inv_perm is None else v_S.index_select(0, lay.inv_perm)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PipelinedAllToAll(torch.autograd.Function):
    """y_TD = sum over the plan's rows r of token t: scores_R[r] * expert_r(x_TD[t]), the experts
    running on their owner ranks, chunk by chunk."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, spec: PipelineSpec, act, w1, w2, w3, b1, b2):
        w = FFNWeights(w1, w2, w3, b1, b2)
        di_mode, h_mode = STRATEGIES[spec.strategy]
        block_rows = spec.block_rows or pipeline_block_rows(w1.shape[2])
        on_host = x_TD.device.type == "cpu"
        keep = any(ctx.needs_input_grad)
        # the received rows stay as they are when they are what backward reads (kept, or
        # "offloaded" on a CPU); otherwise they land in slots the outputs overwrite
        keeps_recv = keep and (di_mode == "keep" or (di_mode == "offload" and on_host))
        kept_x, kept_h = [], []

        def compute(k, lay, x_SD):
            work = work_dtype(x_SD)
            if keep and di_mode != "recomm":
                kept_x.append(x_SD if di_mode == "keep" else to_host(x_SD))
            y_SD = x_SD.new_empty(x_SD.shape) if keeps_recv else x_SD
            dest, done = _row_writer(y_SD, lay)
            h1, h3 = ffn_forward_blocks(
                lay.num_recv, lay.local_counts, w, act, _row_reader(x_SD, lay, work), dest,
                done, like=x_SD, keep_hidden=keep and h_mode != "recompute",
                max_rows=block_rows)
            if keep and h_mode != "recompute":
                kept_h.append((h1, h3) if h_mode == "keep" else (to_host(h1), to_host(h3)))
            return y_SD

        with torch.autocast(x_TD.device.type, enabled=False):
            ring = None if keeps_recv else make_ring(spec, x_TD.shape[1], x_TD)
            spec.stats["recv_buffer_bytes"] = 0 if ring is None else ring.nbytes
            y_TD = forward_chunks(spec, x_TD, scores_R, compute, ring)
            del ring
        spec.stats["offloaded_bytes"] = \
            (_nbytes(kept_x) if di_mode == "offload" else 0) + \
            (_nbytes(t for pair in kept_h for t in pair) if h_mode == "offload" else 0)
        ctx.spec, ctx.act = spec, act
        ctx.kept_x, ctx.kept_h = kept_x, kept_h
        ctx.save_for_backward(x_TD if di_mode == "recomm" else None, scores_R,
                              w1, w2, w3, b1, b2)
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        spec, act = ctx.spec, ctx.act
        x_TD, scores_R, w1, w2, w3, b1, b2 = ctx.saved_tensors
        w = FFNWeights(w1, w2, w3, b1, b2)
        di_mode, h_mode = STRATEGIES[spec.strategy]
        block_rows = spec.block_rows or pipeline_block_rows(w1.shape[2])
        kept_x, kept_h = ctx.kept_x, ctx.kept_h
        need_dx, need_ds = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_needs = ctx.needs_input_grad[4:]
        need_dw = any(w_needs)
        gy_TD = gy_TD.contiguous()
        device = gy_TD.device
        start = mark(gy_TD)
        grads = None

        def compute(k, lay, g_SD, s_S, x_SD):
            nonlocal grads
            if need_dw and grads is None:
                grads = FFNWeights(*(None if p is None else torch.zeros_like(p)
                                     for p in (w1, w2, w3, b1, b2)))
            if di_mode != "recomm":
                x_SD, kept_x[k] = to_device(kept_x[k], device), None
            h1 = h3 = None
            if h_mode != "recompute":
                (h1, h3), kept_h[k] = kept_h[k], None
                h1, h3 = to_device(h1, device), to_device(h3, device)
            work = work_dtype(x_SD)
            scale_S = s_S if lay.perm is None else s_S.index_select(0, lay.perm)
            dest, done = _row_writer(g_SD, lay) if need_dx else (None, None)
            _, dscale_S = ffn_backward_blocks(
                lay.local_counts, w, act, h1, h3, _row_reader(x_SD, lay, work),
                _row_reader(g_SD, lay, work), dest, done, scale_S, need_dw, like=x_SD,
                into=grads, max_rows=block_rows)
            ds_S = _source_order(dscale_S, lay).to(s_S.dtype) if need_ds else None
            return (g_SD if need_dx else None), ds_S

        with torch.autocast(device.type, enabled=False):
            dx_TD, dscores_R = backward_chunks(
                spec, gy_TD, scores_R, x_TD if di_mode == "recomm" else None, compute,
                need_dx, need_ds)
        ctx.kept_x = ctx.kept_h = None
        spec.stats["backward_marks"] = (start, mark(gy_TD))
        out_w = [None] * 5
        if need_dw:
            out_w = [None if g is None or not need else g.mul_(spec.grad_scale)
                     for g, need in zip((grads.w1_EDF, grads.w2_EFD, grads.w3_EDF,
                                         grads.b1_EF, grads.b2_ED), w_needs)]
        return (dx_TD, dscores_R, None, None, *out_w)


def run_grouped_pipeline(x_TD: torch.Tensor, scores_R: torch.Tensor, spec: PipelineSpec,
                         local: GroupedExperts) -> torch.Tensor:
    """`PipelinedAllToAll` over the local grouped experts: y_TD (combined with the scores)."""
    w = local.weights(x_TD.dtype)
    return PipelinedAllToAll.apply(x_TD.contiguous(), scores_R, spec, local.act, w.w1_EDF,
                                   w.w2_EFD, w.w3_EDF, w.b1_EF, w.b2_ED)
