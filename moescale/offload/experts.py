"""OffloadedExperts: grouped FFN/GLU experts whose weights stream from an ExpertStore.

One autograd Function, `OffloadedExpertsFn`, does the whole expert stage of an unpipelined
call; it is the one-chunk case of the offload package's one expert stream
(chunked.py: `StreamedChunkRunner`, which a pipelined exchange drives chunk by chunk):
- forward walks the experts that received rows, in schedule order (pinned experts first, then
  ascending id), each through the DeviceCache (expert i+1 uploads while expert i computes),
  runs the grouped kernel `ffn_forward` on that expert's rows with a single-expert weight slice,
  and keeps only what the activation policy asks: `keep` (the hidden h1 [, h3] on the device),
  `recompute` (nothing: backward recomputes the hidden from the re-fetched weights) or `offload`
  (the hidden copied to the host, brought back in backward). The weights are dropped at once.
- backward walks the same experts (pinned first, then in reverse), re-fetches each, runs
  `ffn_backward` for dX, d(score) and dW, and hands dW to the host optimizer, which adds it
  to the expert's fp32 accumulator (and, eagerly on the last micro-batch, steps the expert).
Experts with no rows are never uploaded. The weights are not autograd inputs: their gradient
leaves through the store. A zero-size `anchor` input that requires grad makes backward run
even when neither x nor the scores need a gradient.

The containers are expert containers (moescale.dispatch.protocol) declaring ROUTED
(`forward_routed(x_TD, plan)`: gather, experts, score-weighted combine fused), STREAMED
(gradients leave through the store) and CHUNKED (`chunk_runner(...)`: a pipelined exchange
drives them chunk by chunk, chunked.py); `forward_rows(x_RD, counts)` takes rows already
grouped (the all-to-all dispatchers). Grouped ones add FFN_SHAPE (the pipeline's cost model).

The per-expert math is the container's: `GroupedExpertMath` here (the grouped kernels on a
single-expert weight slice; also the node's streamed shared store's), `OffloadedModuleExperts`
in module_experts.py (functional_call).

Deliberately not here: the stream's loops (chunked.py), the cache's eviction policy
(cache.py), the optimizer (optimizer.py).

Legend: T tokens, R rows grouped by expert, N rows of one expert, D model width,
F expert hidden width, P parameters of one expert.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import CHUNKED, FFN_SHAPE, ROUTED, STATE_ACCESS, STREAMED
from moescale.layers.activations import Activation
from moescale.layers.experts import compute_dtype
from moescale.layers.grouped_ffn import (PARAM_NAMES, FFNWeights, ffn_backward, ffn_forward,
                                         mm_into)
from moescale.offload.chunked import StreamedChunkRunner
from moescale.offload.store_access import StoreAccess

POLICIES = ("keep", "recompute", "offload")


class OffloadedExpertsFn(torch.autograd.Function):
    """y = experts(x) with weights streamed from the store: the one-chunk case of the
    chunk runner (chunked.py), routed (token_idx_R given) or on rows grouped by expert."""

    @staticmethod
    def forward(ctx, anchor, x, scores_R, token_idx_R, runner: StreamedChunkRunner):
        y = runner.forward(0, x, keep=True, token_idx_R=token_idx_R, scores_R=scores_R)
        ctx.runner = runner
        ctx.save_for_backward(x, scores_R, token_idx_R)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, scores_R, token_idx_R = ctx.saved_tensors
        runner, routed = ctx.runner, token_idx_R is not None
        dx, ds_R = runner.backward(0, x, gy.contiguous(), scores_R, ctx.needs_input_grad[1],
                                   routed and ctx.needs_input_grad[2], token_idx_R=token_idx_R)
        runner.input_grads(())
        ctx.runner = None
        if dx is not None:
            dx = dx.to(x.dtype)
        return None, dx, ds_R, None, None


class OffloadedExpertsBase(nn.Module):
    """The expert seam over an ExpertStore (no parameters). Subclasses give the per-expert
    math for expert e: run_expert(e, x_ND, w_P, keep_hidden) -> (y_ND, hidden or None) and
    run_expert_backward(e, gy_ND, x_ND, w_P, hidden, scale_N, need_dx) -> (dx, grads, ds)."""

    capabilities = frozenset({ROUTED, CHUNKED, STREAMED, STATE_ACCESS})
    stacked_state = False     # state-dict names per expert (module experts); grouped: stacked

    def __init__(self, engine, layer_index: int, num_experts: int, d_model: int,
                 layout) -> None:
        super().__init__()
        self.engine, self.layer_index = engine, layer_index
        self.num_experts, self.d_model, self.layout = num_experts, d_model, layout
        self.anchor = torch.empty(0, requires_grad=True)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        if dtype != self.engine.dtype:
            raise ValueError(f"offloaded experts compute in {self.engine.dtype} but the "
                             f"input arrives in {dtype}; set OffloadConfig(compute_dtype="
                             f"{dtype}) or feed {self.engine.dtype}")
        return x.to(dtype).contiguous()

    @property
    def expert_ids(self) -> range:
        return range(self.num_experts)

    def state_access(self, key: str, optimizer=None, engine=None):
        """STATE_ACCESS: this layer of the engine's store (`engine`: another engine holding it)."""
        owner = engine if engine is not None else self.engine
        return StoreAccess(key, owner.store, self.layer_index, engine=owner,
                           stacked=self.stacked_state)

    def anchor_for_grad_mode(self) -> torch.Tensor:
        """The zero-size input that makes backward run (detached when grad is off)."""
        return self.anchor if torch.is_grad_enabled() else self.anchor.detach()

    def _run(self, x, scores_R, token_idx_R, counts) -> torch.Tensor:
        # the schedule is decided here, where grad mode is the caller's (it is off inside
        # Function.forward): only a forward that will have a backward is traced
        x = self._input(x)
        runner = StreamedChunkRunner(self, [counts], 1.0, traced=torch.is_grad_enabled())
        return OffloadedExpertsFn.apply(self.anchor_for_grad_mode(), x, scores_R, token_idx_R,
                                        runner)

    def forward_routed(self, x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return self._run(x_TD, plan.scores_R, plan.token_idx_R, plan.counts)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return self._run(x_RD, None, None, counts)

    def chunk_runner(self, chunk_counts: Sequence[Sequence[int]], grad_scale: float,
                     x_like: torch.Tensor) -> StreamedChunkRunner:
        """The experts of one pipelined call, chunk by chunk (CHUNKED; chunked.py). Call it
        where grad mode is the caller's: only a call that will have a backward is traced."""
        self._input(x_like[:0])
        return StreamedChunkRunner(self, chunk_counts, grad_scale,
                                   traced=torch.is_grad_enabled())

    def master(self, e: int) -> torch.Tensor:
        """A copy of expert e's flat fp32 master."""
        rec = self.engine.store.acquire((self.layer_index, e))
        try:
            return rec.master_P.to(torch.float32, copy=True)     # a bf16 master: exact
        finally:
            self.engine.store.release((self.layer_index, e))

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert e from its fp32 master (no gradient; for checks against the reference)."""
        with torch.no_grad():
            y_ND, _ = self.run_expert(e, x_ND.float(), self.master(e).to(x_ND.device),
                                      keep_hidden=False)
        return y_ND.to(x_ND.dtype)


class GroupedExpertMath:
    """The per-expert math of grouped FFN/GLU experts over a flat weight copy (the grouped
    kernels on a single-expert slice), for containers with `layout`, `d_ff` and `act`: the
    offloaded ones here and the node's streamed shared store (shared_store/streamed.py)."""

    def weights(self, w_P: torch.Tensor) -> FFNWeights:
        """Single-expert FFNWeights ([1, ...] views) over a flat weight copy."""
        parts = self.layout.split(w_P)
        return FFNWeights(*(parts[name].unsqueeze(0) if name in parts else None
                            for name in PARAM_NAMES))

    def hidden(self, x_ND: torch.Tensor, w: FFNWeights):
        """Recompute (h1_NF, h3_NF or None) for the recompute policy."""
        h1_NF = x_ND.new_empty(x_ND.shape[0], self.d_ff)
        mm_into(h1_NF, x_ND, w.w1_EDF[0], None if w.b1_EF is None else w.b1_EF[0])
        h3_NF = None
        if w.w3_EDF is not None:
            h3_NF = x_ND.new_empty(x_ND.shape[0], self.d_ff)
            mm_into(h3_NF, x_ND, w.w3_EDF[0])
        return h1_NF, h3_NF

    def run_expert(self, e: int, x_ND: torch.Tensor, w_P: torch.Tensor, keep_hidden: bool):
        """(y_ND, hidden to save or None) for one expert's rows."""
        y_ND, h1_NF, h3_NF = ffn_forward(x_ND, (x_ND.shape[0],), self.weights(w_P), self.act)
        if not keep_hidden:
            return y_ND, None
        return y_ND, [h1_NF] if h3_NF is None else [h1_NF, h3_NF]

    def run_expert_backward(self, e: int, gy_ND, x_ND, w_P, hidden, scale_N, need_dx: bool):
        """(dx_ND or None, weight gradients in layout order, d(scale)_N or None)."""
        w = self.weights(w_P)
        h1_NF, h3_NF = self.hidden(x_ND, w) if hidden is None else \
            (hidden[0], hidden[1] if len(hidden) > 1 else None)
        dx_ND, gw, ds_N = ffn_backward(gy_ND, x_ND, h1_NF, h3_NF, (x_ND.shape[0],), w,
                                       self.act, scale_R=scale_N, need_dx=need_dx)
        grads = [g[0] for g in (gw.w1_EDF, gw.w2_EFD, gw.w3_EDF, gw.b1_EF, gw.b2_ED)
                 if g is not None]
        return dx_ND, grads, ds_N


class OffloadedGroupedExperts(GroupedExpertMath, OffloadedExpertsBase):
    """Stand-in for GroupedExperts whose weights live in an ExpertStore (no parameters)."""

    capabilities = OffloadedExpertsBase.capabilities | {FFN_SHAPE}
    stacked_state = True

    def __init__(self, engine, layer_index: int, num_experts: int, d_model: int, d_ff: int,
                 act: Activation, glu: bool, bias: bool, layout) -> None:
        super().__init__(engine, layer_index, num_experts, d_model, layout)
        self.d_ff, self.act, self.glu, self.bias = d_ff, act, glu, bias

    def extra_repr(self) -> str:
        return (f"layer={self.layer_index}, num_experts={self.num_experts}, "
                f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.act.name}, "
                f"glu={self.glu}, bias={self.bias}, offloaded")
