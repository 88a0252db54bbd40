"""The one per-expert stream of offloaded experts: a layer call cut into C >= 1 chunks.

Every offloaded expert call goes through `StreamedChunkRunner`: the unpipelined call
(offload/experts.py) is its one-chunk case, a pipelined all-to-all (MPipeMoE) cuts one layer
call into C chunks and calls it once per chunk (forward k = 0..C-1, then backward k = 0..C-1;
the CHUNKED capability), and the node's shared stores stream through it too
(moescale.shared_store.streamed). Every chunk's per-expert row counts are known up front:

- forward: ONE device-cache walk spans all chunks (chunk 0's experts, then chunk 1's, ...), so
  the first expert of chunk k+1 uploads while the last expert of chunk k computes, and chunk
  k+1's rows travel meanwhile (the pipeline's exchanges). The chunks go in snake order (odd
  ones descending, engine.chunk_orders): chunk k+1 starts with the experts chunk k ended
  with, whose copies the walk retained, so they are not uploaded again (cache.py). Each
  (chunk, expert) keeps what the activation policy asks (keep / recompute / offload) when the
  caller keeps the hidden (`keep`), nothing otherwise (backward recomputes it).
- backward: one walk over the chunks' backward orders (pinned experts first, then each
  chunk's experts in reverse: snake order again), each expert re-fetched (or its retained
  copy reused) with room for its gradient, dX, d(score) and dW computed, dW handed to the
  host optimizer. An expert appears in several chunks: its gradients accumulate in the store
  over the chunks (and micro-batches), and in eager mode it steps only with the gradient of
  its LAST chunk of the last micro-batch (`last_chunk`), so no chunk ever reads a stepped
  master within the step.
- routed rows (the unpipelined call's `forward_routed`): an expert's rows are gathered from
  the tokens (`token_idx_R`) and its output is added, weighted by the score, into an fp32
  combine; backward scatters dX the same way and computes d(score).
- gradient scale: the exchange's 1/W enters through the score (scale_N * grad_scale), so the
  store receives dW at the mean scale and d(score) = <g, y> is untouched; dX is divided by
  grad_scale again (exact for W a power of two, as the unpipelined exchange's scaling).

The runner reaches its owner only through the stream's face (`StreamHost` below): the
offload engine is one, a shared store's pass (shared_store/streamed.py) another.

Weights are never autograd inputs: the container's zero-size anchor is the calling
Function's only extra input, which makes backward run even when neither x nor the scores need
a gradient.

Deliberately not here: the exchange and its buffers (moescale.parallel.pipeline*), the
per-expert math (the container's run_expert / run_expert_backward), eviction (cache.py).

Legend: N rows of one chunk in expert order, T tokens, D model width, P parameters of one
expert.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


def row_starts(counts: Sequence[int]) -> list[int]:
    """Where each expert's rows begin in a block of rows grouped by expert."""
    out, acc = [], 0
    for n in counts:
        out.append(acc)
        acc += n
    return out


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for sums over a token's rows when computing in bf16/fp16."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


class StreamHost(Protocol):
    """What the stream asks of its owner (the offload engine, a shared store's pass)."""

    activation_policy: str      # keep | recompute | offload
    last_micro_batch: bool      # eager steps fire in the last micro-batch's backward

    def chunk_orders(self, layer: int, chunk_counts, traced: bool) -> list[list[int]]: ...

    def chunk_backward_orders(self, layer: int, orders: list[list[int]], last: bool,
                              last_chunk: dict[int, int]) -> list[list[int]]: ...

    def walk(self, layer: int, order: list[int], grad_bytes: int = 0):
        """(expert, weights_P) one after another, uploads overlapped (DeviceCache.walk);
        grad_bytes > 0: backward's walk, with room for one gradient."""

    def reserve_gradient(self, key, nbytes: int): ...

    def stash(self, hidden: list[torch.Tensor]): ...    # the offload policy's copy out

    def unstash(self, stashed) -> list[torch.Tensor]: ...

    def hand_gradient(self, key, grads, reservation, last: bool) -> None: ...


class StreamedChunkRunner:
    """One call of an offloaded layer, chunk by chunk (see the module docstring)."""

    def __init__(self, layer, chunk_counts: Sequence[Sequence[int]], grad_scale: float,
                 traced: bool, host: StreamHost | None = None) -> None:
        self.layer = layer
        self.host = host = layer.engine if host is None else host
        self.grad_scale = grad_scale
        self.counts = [tuple(int(n) for n in c) for c in chunk_counts]
        self.starts = [row_starts(c) for c in self.counts]
        self.orders = host.chunk_orders(layer.layer_index, self.counts, traced)
        self.last_chunk = {e: k for k, c in enumerate(self.counts) for e, n in enumerate(c)
                           if n}
        self.last_micro_batch = host.last_micro_batch
        self.policy = host.activation_policy
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

    def forward(self, k: int, x: torch.Tensor, keep: bool, token_idx_R=None,
                scores_R=None) -> torch.Tensor:
        """Chunk k's experts on rows x (grouped by expert: [N, D]; routed, when token_idx_R
        is given: the tokens [T, D], combined with scores_R in fp32 and returned so)."""
        layer, routed = self.layer, token_idx_R is not None
        if self._walk is None and k == 0:
            self._walk = self.host.walk(layer.layer_index,
                                        [e for order in self.orders for e in order])
        if routed:  # the combine accumulates in fp32 and rounds once
            y = x.new_zeros(x.shape[0], layer.d_model, dtype=acc_dtype(x))
            scores_x = scores_R.to(y.dtype)
        else:
            y = x.new_empty(x.shape[0], layer.d_model)
        keep_hidden = keep and self.policy != "recompute"
        starts, counts = self.starts[k], self.counts[k]
        with torch.autocast(x.device.type, enabled=False):
            for e in self.orders[k]:
                s, n = starts[e], counts[e]
                w_P = self._next(self._walk, e)
                x_ND = x.index_select(0, token_idx_R[s:s + n]) if routed else x[s:s + n]
                y_ND, hidden = layer.run_expert(e, x_ND, w_P, keep_hidden=keep_hidden)
                del w_P
                if routed:
                    y.index_add_(0, token_idx_R[s:s + n],
                                 y_ND.to(y.dtype).mul_(scores_x[s:s + n].unsqueeze(1)))
                else:
                    y[s:s + n] = y_ND
                if hidden is not None:
                    self.saved[k, e] = hidden if self.policy == "keep" else \
                        self.host.stash(hidden)
        self._walk = self._finish(k, self._walk)
        return y

    def backward(self, k, x, g, s_N, need_dx, need_ds, token_idx_R=None):
        """(dX, d(score)) of chunk k: rows grouped by expert, or routed (token_idx_R: x and g
        are the tokens', dX is fp32 in routed mode); s_N: the rows' scores, or None."""
        layer, host, routed = self.layer, self.host, token_idx_R is not None
        grad_bytes = layer.layout.numel * x.element_size()
        if self._back_orders is None:
            self._back_orders = host.chunk_backward_orders(
                layer.layer_index, self.orders, self.last_micro_batch, self.last_chunk)
            self._back_walk = host.walk(
                layer.layer_index, [e for order in self._back_orders for e in order],
                grad_bytes=grad_bytes)
        dx = None
        if need_dx:
            dx = torch.zeros_like(x, dtype=acc_dtype(x)) if routed else x.new_empty(x.shape)
        ds_N = None
        if need_ds:
            ds_N = torch.zeros_like(s_N) if routed else s_N.new_empty(s_N.shape)
        scale_N = None if s_N is None else \
            s_N if self.grad_scale == 1.0 else s_N * self.grad_scale
        starts, counts = self.starts[k], self.counts[k]
        with torch.autocast(x.device.type, enabled=False):
            for e in self._back_orders[k]:
                s, n = starts[e], counts[e]
                if routed:
                    rows_N = token_idx_R[s:s + n]
                    x_ND, g_ND = x.index_select(0, rows_N), g.index_select(0, rows_N)
                else:
                    x_ND, g_ND = x[s:s + n], g[s:s + n]
                w_P = self._next(self._back_walk, e)
                hidden = self.saved.pop((k, e), None)
                if self.policy == "offload" and hidden is not None:
                    hidden = host.unstash(hidden)
                key = (layer.layer_index, e)
                grad_res = host.reserve_gradient(key, grad_bytes)
                dx_e, grads, ds_e = layer.run_expert_backward(
                    e, g_ND, x_ND, w_P, hidden, None if scale_N is None else scale_N[s:s + n],
                    need_dx)
                del w_P, hidden
                if need_dx:
                    if routed:
                        dx.index_add_(0, rows_N, dx_e.to(dx.dtype))
                    else:
                        dx[s:s + n] = dx_e if self.grad_scale == 1.0 else dx_e / self.grad_scale
                if need_ds:
                    ds_N[s:s + n] = ds_e
                host.hand_gradient(key, grads, grad_res,
                                   last=self.last_micro_batch and k == self.last_chunk[e])
        self._back_walk = self._finish(k, self._back_walk)
        return dx, ds_N

    def input_grads(self, needs: Sequence[bool]) -> list[torch.Tensor | None]:
        self.saved.clear()
        return [None] * len(needs)
