"""The one expert interface: what every expert container offers a dispatcher.

A dispatcher owns the exchange (local gather, static all-to-all, pipelined all-to-all, dynamic
placement) and calls the container; the container owns where the weights live (resident
parameters, a host or disk store streamed through a device cache, a shared store). Every
container computes rows already in expert order:

  forward_rows(x_RD, counts_E) -> y_RD    counts_E[l] consecutive rows for held expert l
                                          (experts in `expert_ids` order), outputs in the
                                          same order; differentiable

and declares, in `capabilities`, which faster or richer entry points it also has. Dispatchers
choose a fast path by capability, never by probing attributes:

  ROUTED           forward_routed(x_TD, plan) -> y_TD: gather, experts and score-weighted
                   combine fused (the local dispatcher's fast path)
  GROUPED_WEIGHTS  weights(dtype) -> stacked FFNWeights of resident parameters, plus `act`:
                   the pipelined all-to-all runs the grouped kernels on them (all strategies)
  FFN_SHAPE        d_model, d_ff, glu, bias: the FFN shape the cost model and the memory
                   formulas read (strategy "auto")
  CHUNKED          chunk_runner(chunk_counts, grad_scale) -> ChunkRunner: the container runs
                   its own experts chunk by chunk for a pipelined exchange (an offloaded store
                   uploads chunk k+1's experts while chunk k computes, and steps an expert
                   only after its last chunk's backward)
  STREAMED         the weights are not parameters: gradients leave through the container's
                   store (a dispatcher that must reduce parameter gradients itself refuses it)
  PLACED           forward_placed(x_RD, counts_E, owners_E, split_experts, group): the
                   container accumulates the placement's gradients itself (shared store)
  SHARD            a slice of a layer's experts (expert parallelism): `local` is the inner
                   container, whose capabilities the shard passes on
  STATE_ACCESS     state_access(key, optimizer=None, engine=None) -> ExpertState: the held
                   experts' weights and optimizer state, read and written one expert at a
                   time (moescale.layers.state_access); checkpoints, export and resharding
                   reach expert state only through it

Containers without CHUNKED are pipelined by `AutogradChunkRunner`: the chunk's rows through
`forward_rows` under autograd, kept or re-run in backward (activation checkpointing per chunk).

It lives in moescale.dispatch, the seam's room, beside the index math every exchange shares;
the exchanges that communicate are in moescale.parallel, the residencies in
moescale.layers.experts, moescale.offload and moescale.shared_store. Nothing here communicates
or imports the rest of moescale.

Legend: R rows grouped by expert, N rows of one chunk in expert order, T tokens, D model width.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, Sequence, runtime_checkable

import torch

ROUTED = "routed"
GROUPED_WEIGHTS = "grouped_weights"
FFN_SHAPE = "ffn_shape"
CHUNKED = "chunked"
STREAMED = "streamed"
PLACED = "placed"
SHARD = "shard"
STATE_ACCESS = "state_access"
CAPABILITIES = frozenset({ROUTED, GROUPED_WEIGHTS, FFN_SHAPE, CHUNKED, STREAMED, PLACED, SHARD,
                          STATE_ACCESS})


@runtime_checkable
class ExpertContainer(Protocol):
    """What every expert container is (see the module docstring)."""

    num_experts: int               # the layer's experts E (all ranks together)
    capabilities: frozenset[str]   # names from CAPABILITIES

    @property
    def expert_ids(self) -> range:
        """The global ids of the experts held here, in row order (range(E) unless a shard)."""

    def forward_rows(self, x_RD: torch.Tensor, counts_E: Sequence[int]) -> torch.Tensor:
        """Rows grouped by held expert -> outputs in the same order (differentiable)."""

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Global expert e on rows x_ND by plain ops (the reference oracle and checks)."""


@runtime_checkable
class ChunkRunner(Protocol):
    """One layer call's experts, run chunk by chunk by a pipelined exchange.

    Forward calls forward(k, ...) for k = 0..C-1 in order; backward calls backward(k, ...)
    for k = 0..C-1 in order (each chunk's backward once, after every forward), then
    input_grads once. Rows are in expert order (chunk k's counts were given up front)."""

    def autograd_inputs(self) -> tuple[torch.Tensor, ...]:
        """Tensors the pipeline Function takes as inputs (their gradients: input_grads)."""

    def forward(self, k: int, x_ND: torch.Tensor, keep: bool) -> torch.Tensor:
        """Chunk k's outputs (no autograd graph). keep: keep what backward needs of this chunk
        besides its input (the hidden, or the autograd graph); False: backward recomputes."""

    def backward(self, k: int, x_ND: torch.Tensor | None, g_ND: torch.Tensor,
                 s_N: torch.Tensor, need_dx: bool, need_ds: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx_ND, ds_N) of chunk k, whose output y_ND entered the loss as s_N * y_ND with
        output gradient g_ND. x_ND: the chunk's input again (None when forward kept it).
        Weight gradients are scaled by the runner's grad_scale; dx and ds are not."""

    def input_grads(self, needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """Gradients of autograd_inputs() after the last chunk's backward."""


def capabilities_of(experts) -> frozenset[str]:
    """The container's declared capabilities; a ValueError naming the fix when it declares
    none (a user container must say what it offers, even if nothing: frozenset())."""
    if not isinstance(experts, ExpertContainer):
        raise ValueError(f"{type(experts).__name__} is not an expert container: it needs "
                         "num_experts, expert_ids, capabilities (a frozenset, possibly empty), "
                         "forward_rows(x_RD, counts_E) and expert_forward(e, x_ND); see "
                         "moescale.dispatch.protocol")
    return experts.capabilities


def _autocast(state):
    device_type, enabled, dtype = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


class AutogradChunkRunner:
    """Any container's forward_rows, chunk by chunk, as activation checkpointing per chunk:
    forward keeps the chunk's autograd graph (keep=True) or nothing (keep=False: backward
    re-runs the chunk from its input, under the forward's autocast state; modules with
    randomness draw new numbers in the re-run). Parameter gradients are accumulated over the
    chunks and scaled by grad_scale once; the score gradient is <g, y>."""

    def __init__(self, experts, chunk_counts: Sequence[Sequence[int]], grad_scale: float,
                 x_like: torch.Tensor) -> None:
        self.experts, self.grad_scale = experts, grad_scale
        self.counts = [tuple(c) for c in chunk_counts]
        dev = x_like.device.type
        self.state = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self.params = tuple(p for p in experts.parameters() if p.requires_grad)
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: list[torch.Tensor | None] = []

    def autograd_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.params

    def _run(self, k: int, x_ND: torch.Tensor):
        with torch.enable_grad(), _autocast(self.state):
            x_leaf_ND = x_ND.detach().requires_grad_(True)
            return x_leaf_ND, self.experts.forward_rows(x_leaf_ND, self.counts[k])

    def forward(self, k: int, x_ND: torch.Tensor, keep: bool) -> torch.Tensor:
        if keep:
            x_leaf_ND, y_ND = self._run(k, x_ND)
            self.kept[k] = (x_leaf_ND, y_ND)
            return y_ND.detach()
        with torch.no_grad(), _autocast(self.state):
            return self.experts.forward_rows(x_ND, self.counts[k])

    def backward(self, k, x_ND, g_ND, s_N, need_dx, need_ds):
        if k in self.kept:
            x_leaf_ND, y_ND = self.kept.pop(k)
        else:
            x_leaf_ND, y_ND = self._run(k, x_ND)
        if not self.grads:
            self.grads = [None] * len(self.params)
        ds_N = (g_ND.float() * y_ND.detach().float()).sum(1).to(s_N.dtype) if need_ds else None
        inputs = [x_leaf_ND, *self.params]
        if y_ND.requires_grad:
            g_scaled_ND = (g_ND * s_N.to(g_ND.dtype).unsqueeze(1)).to(y_ND.dtype)
            got = torch.autograd.grad(y_ND, inputs, g_scaled_ND, allow_unused=True)
        else:                      # no rows here: nothing reached the experts
            got = [None] * len(inputs)
        dx_ND = None
        if need_dx:
            dx_ND = got[0] if got[0] is not None else torch.zeros_like(x_leaf_ND)
        self.grads = [g if acc is None else (acc if g is None else acc.add_(g))
                      for acc, g in zip(self.grads, got[1:])]
        return dx_ND, ds_N

    def input_grads(self, needs: Sequence[bool]) -> list[torch.Tensor | None]:
        grads = self.grads or [None] * len(self.params)
        return [None if not need else
                torch.zeros_like(p) if g is None else g.mul_(self.grad_scale)
                for p, g, need in zip(self.params, grads, needs)]
