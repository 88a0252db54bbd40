"""The pipelined exchange for any expert container (FastMoE's "any module is an expert", and
ES-MoE's offloaded experts).

`PipelinedRowsAllToAll` has the same chunking, overlap, process groups and fused combine as
`PipelinedAllToAll` (both drive their chunks with pipeline_schedule's `forward_chunks` /
`backward_chunks`) but hands each chunk's rows, in expert order, to a `ChunkRunner`
(moescale.dispatch.protocol) instead of running the grouped FFN kernels itself:

  - a container that declares CHUNKED gives its own runner (`chunk_runner`): offloaded
    experts stream their weights from the store through the device cache across the chunks
    and step an expert after its last chunk's backward (moescale.offload.chunked);
  - any other container (module experts) is run by `AutogradChunkRunner`: the chunk through
    `forward_rows` under autograd, like activation checkpointing per chunk.

What the pipeline keeps of a chunk's dispatched input (DI) follows the strategy; the hidden
activations are the runner's business (kept when the strategy keeps DI, recomputed otherwise):

  none   DI kept; the runner keeps what backward needs (the autograd graph, or the hidden
         per the offload activation policy)
  S2     DI offloaded; backward reloads it and the runner recomputes the chunk
  S4     DI re-communicated; backward re-dispatches it and the runner recomputes the chunk

(S1/S3 offload the hidden activation, which only the grouped kernels expose.) The score
gradient of a row is <output grad, expert output>. Expert weight gradients are scaled by 1/W
(`spec.grad_scale`) like everywhere else in expert parallelism; input gradients are not.

Legend: T tokens, R rows sent, S rows received in one chunk (source-major), N the same rows in
expert-major order, D model width, W ranks of the EP group.
"""

from __future__ import annotations

import torch

from moescale.dispatch.chunk_layout import ChunkLayout
from moescale.parallel.cost_model import STRATEGIES
from moescale.parallel.pipeline_schedule import (PipelineSpec, backward_chunks, forward_chunks,
                                                 make_ring, to_device, to_host)

MODULE_STRATEGIES = ("none", "S2", "S4")


def _expert_order(t: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return t if lay.perm is None else t.index_select(0, lay.perm)


def _source_order(t: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return t if lay.inv_perm is None else t.index_select(0, lay.inv_perm)


def check_rows_strategy(strategy: str) -> None:
    """ValueError unless a ChunkRunner pipeline serves `strategy`."""
    if strategy not in MODULE_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} offloads the hidden activation, which only "
                         "resident grouped experts expose; use one of "
                         f"{', '.join(MODULE_STRATEGIES)} for these experts")


class PipelinedRowsAllToAll(torch.autograd.Function):
    """y_TD = sum over the plan's rows r of token t: scores_R[r] * expert_r(x_TD[t]) on the
    owners, the experts run by `runner` chunk by chunk; `inputs` are the runner's
    autograd_inputs() (parameters, or an offloaded container's anchor)."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, spec: PipelineSpec, runner, *inputs):
        check_rows_strategy(spec.strategy)
        di_mode = STRATEGIES[spec.strategy][0]
        keep = any(ctx.needs_input_grad)
        kept = []

        def compute(k, lay, x_SD):
            x_ND = _expert_order(x_SD, lay)
            y_ND = runner.forward(k, x_ND, keep=keep and di_mode == "keep")
            if keep and di_mode != "recomm":
                kept.append(x_ND if di_mode == "keep" else to_host(x_ND))
            return _source_order(y_ND.to(x_SD.dtype), lay)

        ring = None if keep and di_mode != "recomm" else make_ring(spec, x_TD.shape[1], x_TD)
        y_TD = forward_chunks(spec, x_TD, scores_R, compute, ring)
        del ring
        ctx.spec, ctx.runner, ctx.kept = spec, runner, kept
        ctx.save_for_backward(x_TD if di_mode == "recomm" else None, scores_R)
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        spec, runner, kept = ctx.spec, ctx.runner, ctx.kept
        x_TD, scores_R = ctx.saved_tensors
        di_mode = STRATEGIES[spec.strategy][0]
        need_dx, need_ds = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gy_TD = gy_TD.contiguous()

        def compute(k, lay, g_SD, s_S, x_SD):
            if di_mode == "recomm":
                x_ND = _expert_order(x_SD, lay)
            else:
                x_ND, kept[k] = to_device(kept[k], gy_TD.device), None
            dx_ND, ds_N = runner.backward(k, x_ND, _expert_order(g_SD, lay),
                                          _expert_order(s_S, lay), need_dx, need_ds)
            dx_SD = None if dx_ND is None else _source_order(dx_ND.to(g_SD.dtype), lay)
            ds_S = None if ds_N is None else _source_order(ds_N.to(s_S.dtype), lay)
            return dx_SD, ds_S

        dx_TD, dscores_R = backward_chunks(spec, gy_TD, scores_R,
                                           x_TD if di_mode == "recomm" else None, compute,
                                           need_dx, need_ds)
        ctx.kept = ctx.runner = None
        return (dx_TD, dscores_R, None, None, *runner.input_grads(ctx.needs_input_grad[4:]))
