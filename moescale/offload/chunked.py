"""Offloaded experts driven chunk by chunk by a pipelined exchange (the CHUNKED capability).

A pipelined all-to-all (MPipeMoE) cuts one layer call into C chunks and calls the container
once per chunk, forward k = 0..C-1, then backward k = 0..C-1. `StreamedChunkRunner` is what an
offloaded container (ES-MoE's store + device cache) hands it for one call, with every chunk's
per-expert row counts known up front:

- forward: ONE device-cache walk spans all chunks (chunk 0's experts, then chunk 1's, ...), so
  the first expert of chunk k+1 uploads while the last expert of chunk k computes, and chunk
  k+1's rows travel meanwhile (the pipeline's exchanges). The chunks go in snake order (odd
  ones descending, engine.chunk_orders): chunk k+1 starts with the experts chunk k ended
  with, whose copies the walk retained, so they are not uploaded again (cache.py). Each
  (chunk, expert) keeps what the activation policy asks (keep / recompute / offload) when the
  pipeline's strategy keeps the hidden (`keep`), nothing otherwise (backward recomputes it).
- backward: one walk over the chunks' backward orders (pinned experts first, then each
  chunk's experts in reverse: snake order again), each expert re-fetched (or its retained
  copy reused) with room for its gradient, dX, d(score) and dW computed, dW handed to the
  host optimizer. An expert appears in several chunks: its gradients accumulate in the store
  over the chunks (and micro-batches), and in eager mode it steps only with the gradient of
  its LAST chunk of the last micro-batch (`last_chunk`), so no chunk ever reads a stepped
  master within the step.
- gradient scale: the exchange's 1/W enters through the score (scale_N * grad_scale), so the
  store receives dW at the mean scale and d(score) = <g, y> is untouched; dX is divided by
  grad_scale again (exact for W a power of two, as the unpipelined exchange's scaling).

Weights are never autograd inputs: the container's zero-size anchor is the pipeline
Function's only extra input, which makes backward run even when neither x nor the scores need
a gradient.

Deliberately not here: the exchange and its buffers (moescale.parallel.pipeline*), the
per-expert math (the container's run_expert / run_expert_backward), eviction (cache.py).

Legend: N rows of one chunk in expert order, D model width, P parameters of one expert.
"""

from __future__ import annotations

from typing import Sequence

import torch


def row_starts(counts: Sequence[int]) -> list[int]:
    """Where each expert's rows begin in a block of rows grouped by expert."""
    out, acc = [], 0
    for n in counts:
        out.append(acc)
        acc += n
    return out


class StreamedChunkRunner:
    """One call of an offloaded layer, chunk by chunk (see the module docstring)."""

    def __init__(self, layer, chunk_counts: Sequence[Sequence[int]], grad_scale: float,
                 traced: bool) -> None:
        self.layer, self.engine = layer, layer.engine
        self.grad_scale = grad_scale
        self.counts = [tuple(int(n) for n in c) for c in chunk_counts]
        self.starts = [row_starts(c) for c in self.counts]
        self.orders = self.engine.chunk_orders(layer.layer_index, self.counts, traced)
        self.last_chunk = {e: k for k, c in enumerate(self.counts) for e, n in enumerate(c)
                           if n}
        self.last_micro_batch = self.engine.last_micro_batch
        self.policy = self.engine.config.activation_policy
        self.saved: dict[tuple[int, int], object] = {}
        self._walk = self._back_walk = None
        self._back_orders: list[list[int]] | None = None

    def autograd_inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.layer.anchor_for_grad_mode(),)

    def _next(self, walk, e: int) -> torch.Tensor:
        got, w_P = next(walk)
        assert got == e, (got, e)
        return w_P

    def _finish(self, k: int, walk):
        if k == len(self.counts) - 1 and walk is not None:
            walk.close()            # releases the last expert's slot
            return None
        return walk

    def forward(self, k: int, x_ND: torch.Tensor, keep: bool) -> torch.Tensor:
        engine, layer = self.engine, self.layer
        if self._walk is None and k == 0:
            self._walk = engine.cache.walk(layer.layer_index,
                                           [e for order in self.orders for e in order])
        y_ND = x_ND.new_empty(x_ND.shape[0], layer.d_model)
        keep_hidden = keep and self.policy != "recompute"
        with torch.autocast(x_ND.device.type, enabled=False):
            for e in self.orders[k]:
                s, n = self.starts[k][e], self.counts[k][e]
                w_P = self._next(self._walk, e)
                y_e, hidden = layer.run_expert(e, x_ND[s:s + n], w_P, keep_hidden=keep_hidden)
                del w_P
                y_ND[s:s + n] = y_e
                if hidden is not None:
                    self.saved[k, e] = hidden if self.policy == "keep" else \
                        engine.device.download(hidden)
        self._walk = self._finish(k, self._walk)
        return y_ND

    def backward(self, k, x_ND, g_ND, s_N, need_dx, need_ds):
        engine, layer = self.engine, self.layer
        if self._back_orders is None:
            self._back_orders = engine.chunk_backward_orders(
                layer.layer_index, self.orders, self.last_micro_batch, self.last_chunk)
            self._back_walk = engine.cache.walk(
                layer.layer_index, [e for order in self._back_orders for e in order],
                headroom=layer.layout.numel * x_ND.element_size(), whole_record=True)
        grad_bytes = layer.layout.numel * x_ND.element_size()
        dx_ND = x_ND.new_empty(x_ND.shape) if need_dx else None
        ds_N = s_N.new_empty(s_N.shape) if need_ds else None
        scale_N = s_N * self.grad_scale
        with torch.autocast(x_ND.device.type, enabled=False):
            for e in self._back_orders[k]:
                s, n = self.starts[k][e], self.counts[k][e]
                w_P = self._next(self._back_walk, e)
                hidden = self.saved.pop((k, e), None)
                if self.policy == "offload" and hidden is not None:
                    hidden = engine.device.upload(hidden.wait()).wait()
                key = (layer.layer_index, e)
                grad_res = engine.device.reserve(grad_bytes, f"gradient of expert {key}",
                                                 block=True, async_release=True)
                dx_e, grads, ds_e = layer.run_expert_backward(
                    e, g_ND[s:s + n], x_ND[s:s + n], w_P, hidden, scale_N[s:s + n], need_dx)
                del w_P, hidden
                if need_dx:
                    dx_ND[s:s + n] = dx_e / self.grad_scale
                if need_ds:
                    ds_N[s:s + n] = ds_e
                engine.hand_gradient(key, grads, grad_res,
                                     last=self.last_micro_batch and k == self.last_chunk[e])
        self._back_walk = self._finish(k, self._back_walk)
        return dx_ND, ds_N

    def input_grads(self, needs: Sequence[bool]) -> list[torch.Tensor | None]:
        self.saved.clear()
        return [None] * len(needs)
