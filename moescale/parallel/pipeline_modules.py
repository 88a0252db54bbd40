"""The pipelined exchange for any expert modules (FastMoE's "any module is an expert").

`PipelinedModuleAllToAll` has the same chunking, overlap, process groups and fused combine as
`PipelinedAllToAll` (both drive their chunks with pipeline_schedule's `forward_chunks` /
`backward_chunks`) but runs `experts.forward_rows` (any
`ModuleExperts`) instead of the grouped FFN kernels. The hidden activations of arbitrary modules
are not visible, so backward works like activation checkpointing per chunk:

  none   each chunk's autograd graph is kept (memory as without pipelining)
  S2     the dispatched input is offloaded; backward reloads it and re-runs the chunk
  S4     the dispatched input is re-communicated; backward re-runs the chunk

(S1/S3 offload the hidden activation, which only grouped experts expose.) A re-run sees the
forward's autocast state; modules with randomness (dropout) draw new numbers in the re-run,
as with non-preserving checkpointing. The score gradient of a row is <output grad, expert
output> (the kept or re-run output). Expert parameter gradients are scaled by 1/W like
everywhere else in expert parallelism; input gradients are not.

Legend: T tokens, R rows sent, S rows received in one chunk (source-major), N the same rows in
expert-major order, D model width, W ranks of the EP group.
"""

from __future__ import annotations

import contextlib

import torch

from moescale.parallel.cost_model import STRATEGIES
from moescale.parallel.pipeline_layout import ChunkLayout, PipelineSpec
from moescale.parallel.pipeline_schedule import (backward_chunks, forward_chunks, make_ring,
                                                 to_device, to_host)

MODULE_STRATEGIES = ("none", "S2", "S4")


def _autocast(state):
    device_type, enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _run(experts, x_ND, counts, state, need_dx):
    """(x_leaf_ND, y_ND) with an autograd graph to x_leaf_ND and the experts' parameters."""
    with torch.enable_grad(), _autocast(state):
        x_leaf_ND = x_ND.detach().requires_grad_(need_dx)
        return x_leaf_ND, experts.forward_rows(x_leaf_ND, counts)


def _expert_order(t: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return t if lay.perm is None else t.index_select(0, lay.perm)


def _source_order(t: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    return t if lay.inv_perm is None else t.index_select(0, lay.inv_perm)


class PipelinedModuleAllToAll(torch.autograd.Function):
    """y_TD = sum over the plan's rows r of token t: scores_R[r] * expert_r(x_TD[t]) on the
    owners, any expert modules."""

    @staticmethod
    def forward(ctx, x_TD, scores_R, spec: PipelineSpec, experts, *params):
        if spec.strategy not in MODULE_STRATEGIES:
            raise ValueError(f"strategy={spec.strategy!r} offloads the hidden activation, which "
                             "only grouped experts expose; use one of "
                             f"{', '.join(MODULE_STRATEGIES)} for module experts")
        di_mode = STRATEGIES[spec.strategy][0]
        dev = x_TD.device.type
        state = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        need_dx = ctx.needs_input_grad[0]
        keep = any(ctx.needs_input_grad)
        kept = []

        def compute(k, lay, x_SD):
            x_ND = _expert_order(x_SD, lay)
            if keep and di_mode == "keep":
                x_leaf_ND, y_ND = _run(experts, x_ND, lay.local_counts, state, need_dx)
                kept.append((x_leaf_ND, y_ND))
                y_ND = y_ND.detach()
            else:
                with torch.no_grad(), _autocast(state):
                    y_ND = experts.forward_rows(x_ND, lay.local_counts)
                if keep and di_mode == "offload":
                    kept.append(to_host(x_ND))
            return _source_order(y_ND.to(x_SD.dtype), lay)

        ring = None if keep and di_mode != "recomm" else make_ring(spec, x_TD.shape[1], x_TD)
        y_TD = forward_chunks(spec, x_TD, scores_R, compute, ring)
        del ring
        ctx.spec, ctx.experts, ctx.state, ctx.kept = spec, experts, state, kept
        ctx.save_for_backward(x_TD if di_mode == "recomm" else None, scores_R, *params)
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        spec, experts = ctx.spec, ctx.experts
        x_TD, scores_R, *params = ctx.saved_tensors
        di_mode = STRATEGIES[spec.strategy][0]
        need_dx, need_ds = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        p_needs = ctx.needs_input_grad[4:]
        wanted = [p for p, need in zip(params, p_needs) if need]
        gy_TD = gy_TD.contiguous()
        grads = [None] * len(wanted)
        kept = ctx.kept

        def compute(k, lay, g_SD, s_S, x_SD):
            nonlocal grads
            if di_mode == "keep":
                (x_leaf_ND, y_ND), kept[k] = kept[k], None
            else:
                if di_mode == "offload":
                    x_ND, kept[k] = to_device(kept[k], gy_TD.device), None
                else:
                    x_ND = _expert_order(x_SD, lay)
                x_leaf_ND, y_ND = _run(experts, x_ND, lay.local_counts, ctx.state, need_dx)
            g_ND = _expert_order(g_SD, lay)
            s_N = _expert_order(s_S, lay)
            ds_S = None
            if need_ds:
                ds_N = (g_ND.float() * y_ND.detach().float()).sum(1)
                ds_S = _source_order(ds_N.to(s_S.dtype), lay)
            inputs = ([x_leaf_ND] if need_dx else []) + wanted
            if y_ND.requires_grad and inputs:
                g_scaled_ND = (g_ND * s_N.to(g_ND.dtype).unsqueeze(1)).to(y_ND.dtype)
                got = torch.autograd.grad(y_ND, inputs, g_scaled_ND, allow_unused=True)
            else:                      # no rows here: nothing reached the experts
                got = [None] * len(inputs)
            dx_SD = None
            if need_dx:
                dx_ND = got[0] if got[0] is not None else torch.zeros_like(x_leaf_ND)
                dx_SD = _source_order(dx_ND.to(g_SD.dtype), lay)
                got = got[1:]
            grads = [g if acc is None else (acc if g is None else acc.add_(g))
                     for acc, g in zip(grads, got)]
            return dx_SD, ds_S

        dx_TD, dscores_R = backward_chunks(spec, gy_TD, scores_R,
                                           x_TD if di_mode == "recomm" else None, compute,
                                           need_dx, need_ds)
        ctx.kept = None
        it = iter(grads)
        out = []
        for p, need in zip(params, p_needs):
            if not need:
                out.append(None)
                continue
            g = next(it)
            out.append(torch.zeros_like(p) if g is None else g.mul_(spec.grad_scale))
        return (dx_TD, dscores_R, None, None, *out)
