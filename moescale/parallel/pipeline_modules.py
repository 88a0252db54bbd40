"""The pipelined exchange for any expert modules (FastMoE's "any module is an expert").

`PipelinedModuleAllToAll` has the same chunking, overlap and process groups as
`PipelinedAllToAll` (moescale.parallel.pipeline: both drive their chunks with its
`forward_chunks` / `backward_chunks`) but runs `experts.forward_rows` (any
`ModuleExperts`) instead of the grouped FFN kernels. The hidden activations of arbitrary modules
are not visible, so backward works like activation checkpointing per chunk:

  none   each chunk's autograd graph is kept (memory as without pipelining)
  S2     the dispatched input is offloaded; backward reloads it and re-runs the chunk
  S4     the dispatched input is re-communicated; backward re-runs the chunk

(S1/S3 offload the hidden activation, which only grouped experts expose.) A re-run sees the
forward's autocast state; modules with randomness (dropout) draw new numbers in the re-run,
as with non-preserving checkpointing. Expert parameter gradients are scaled by 1/W like
everywhere else in expert parallelism; input gradients are not.

Legend: T tokens, R rows sent, D model width, W ranks of the EP group.
"""

from __future__ import annotations

import contextlib

import torch

from moescale.parallel.cost_model import STRATEGIES
from moescale.parallel.pipeline import (PipelineSpec, _Dispatcher, _offload, _reload,
                                        backward_chunks, forward_chunks)

MODULE_STRATEGIES = ("none", "S2", "S4")


def _autocast(state):
    device_type, enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _run(experts, x_loc, counts, state, need_dx):
    """(x_leaf, y_loc) with an autograd graph to x_leaf and the experts' parameters."""
    with torch.enable_grad(), _autocast(state):
        x_leaf = x_loc.detach().requires_grad_(need_dx)
        return x_leaf, experts.forward_rows(x_leaf, counts)


class PipelinedModuleAllToAll(torch.autograd.Function):
    """y_RD (plan row order) = experts(x_TD[token of each row]) on the owners, any modules."""

    @staticmethod
    def forward(ctx, x_TD, spec: PipelineSpec, experts, *params):
        if spec.strategy not in MODULE_STRATEGIES:
            raise ValueError(f"strategy={spec.strategy!r} offloads the hidden activation, which "
                             "only grouped experts expose; use one of "
                             f"{', '.join(MODULE_STRATEGIES)} for module experts")
        di_mode = STRATEGIES[spec.strategy][0]
        dev = x_TD.device.type
        state = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        need_dx = ctx.needs_input_grad[0]
        kept = []

        def compute(k, lay, x_loc):
            if di_mode == "keep":
                x_leaf, y_loc = _run(experts, x_loc, lay.local_counts, state, need_dx)
                kept.append((x_leaf, y_loc))
                return y_loc.detach()
            with torch.no_grad(), _autocast(state):
                y_loc = experts.forward_rows(x_loc, lay.local_counts)
            if di_mode == "offload":
                kept.append(_offload(x_loc))
            return y_loc

        disp = _Dispatcher(x_TD, spec, reuse=spec.strategy != "none")
        y_RD = x_TD.new_empty(spec.num_rows, x_TD.shape[1])
        forward_chunks(spec, disp, y_RD, compute)
        ctx.spec, ctx.experts, ctx.state, ctx.kept = spec, experts, state, kept
        ctx.num_tokens = x_TD.shape[0]
        ctx.save_for_backward(x_TD if di_mode == "recomm" else None, *params)
        return y_RD

    @staticmethod
    def backward(ctx, gy_RD):
        spec, experts = ctx.spec, ctx.experts
        x_TD, *params = ctx.saved_tensors
        di_mode = STRATEGIES[spec.strategy][0]
        need_dx, p_needs = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        wanted = [p for p, need in zip(params, p_needs) if need]
        gy_RD = gy_RD.contiguous()
        grads = [None] * len(wanted)

        def compute(k, lay, g_loc, x_loc):
            nonlocal grads
            if di_mode == "keep":
                x_leaf, y_loc = ctx.kept[k]
            else:
                if di_mode == "offload":
                    x_loc = _reload(ctx.kept[k], gy_RD.device)
                x_leaf, y_loc = _run(experts, x_loc, lay.local_counts, ctx.state, need_dx)
            inputs = ([x_leaf] if need_dx else []) + wanted
            if y_loc.requires_grad and inputs:
                got = torch.autograd.grad(y_loc, inputs, g_loc.to(y_loc.dtype),
                                          allow_unused=True)
            else:                      # no rows here: nothing reached the experts
                got = [None] * len(inputs)
            dx_loc = None
            if need_dx:
                dx_loc = got[0] if got[0] is not None else torch.zeros_like(x_leaf)
                got = got[1:]
            grads = [g if acc is None else (acc if g is None else acc.add_(g))
                     for acc, g in zip(grads, got)]
            return dx_loc

        dx_TD = backward_chunks(spec, gy_RD, x_TD if di_mode == "recomm" else None, compute,
                                need_dx, ctx.num_tokens)
        ctx.kept = None
        it = iter(grads)
        out = []
        for p, need in zip(params, p_needs):
            if not need:
                out.append(None)
                continue
            g = next(it)
            out.append(torch.zeros_like(p) if g is None else g.mul_(spec.grad_scale))
        return (dx_TD, None, None, *out)
