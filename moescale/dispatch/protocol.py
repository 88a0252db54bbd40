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
  GRAD_TENSORS     grad_tensors() -> every tensor requiring grad that forward_rows reads
                   (parameters included): what a pipelined exchange differentiates when the
                   weights are not (all) `parameters()`, e.g. plain tensors with requires_grad

Containers without CHUNKED are pipelined by `AutogradChunkRunner`: the chunk's rows through
`forward_rows` under autograd, kept or re-run in backward (activation checkpointing per chunk).
Its gradients leave only through the pipeline Function's inputs, so it differentiates the
tensors the container names (`grad_tensors()` under GRAD_TENSORS, else `parameters()`) and
refuses, in one line naming GRAD_TENSORS, a chunk whose autograd graph reaches a tensor
requiring grad that is not named (it would silently get no gradient). STREAMED containers are
not checked: their weight gradients leave through their store by declaration.

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
from torch import nn

ROUTED = "routed"
GROUPED_WEIGHTS = "grouped_weights"
FFN_SHAPE = "ffn_shape"
CHUNKED = "chunked"
STREAMED = "streamed"
PLACED = "placed"
SHARD = "shard"
STATE_ACCESS = "state_access"
GRAD_TENSORS = "grad_tensors"
CAPABILITIES = frozenset({ROUTED, GROUPED_WEIGHTS, FFN_SHAPE, CHUNKED, STREAMED, PLACED, SHARD,
                          STATE_ACCESS, GRAD_TENSORS})


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


def unnamed_grad_tensors(y: torch.Tensor, named: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that y's autograd graph reaches other than through
    `named` (y's gradient stops at a named tensor, leaf or not)."""
    if y.grad_fn is None:
        return []
    stops = set()
    for t in named:
        edge = torch.autograd.graph.get_gradient_edge(t)
        stops.add((edge.node, edge.output_nr))
    found: dict[int, torch.Tensor] = {}
    todo, seen = [y.grad_fn], {y.grad_fn}
    while todo:
        for node, nr in todo.pop().next_functions:
            if node is None or (node, nr) in stops or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "AccumulateGrad":
                found[id(node.variable)] = node.variable
            else:
                todo.append(node)
    return list(found.values())


class AutogradChunkRunner:
    """Any container's forward_rows, chunk by chunk, as activation checkpointing per chunk:
    forward keeps the chunk's autograd graph (keep=True) or nothing (keep=False: backward
    re-runs the chunk from its input, under the forward's autocast state; modules with
    randomness draw new numbers in the re-run). It differentiates the container's
    `grad_tensors()` (GRAD_TENSORS) or else its `parameters()` that require grad; their
    gradients are accumulated over the chunks and scaled by grad_scale once; the score gradient
    is <g, y>.

    Every chunk's graph is checked once (in forward when kept, or when nothing the exchange's
    backward follows needs a gradient; else in backward): a tensor requiring grad that it
    reaches beyond those is refused with a ValueError naming GRAD_TENSORS (it would get no
    gradient). STREAMED containers are not checked (gradients leave through their store)."""

    def __init__(self, experts, chunk_counts: Sequence[Sequence[int]], grad_scale: float,
                 x_like: torch.Tensor) -> None:
        self.experts, self.grad_scale = experts, grad_scale
        self.counts = [tuple(c) for c in chunk_counts]
        dev = x_like.device.type
        self.state = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        caps = capabilities_of(experts)
        if GRAD_TENSORS in caps:
            named = experts.grad_tensors()
        elif isinstance(experts, nn.Module):
            named = experts.parameters()
        else:
            raise ValueError(f"{type(experts).__name__} is not an nn.Module, so it has no "
                             "parameters() to differentiate under a pipelined exchange; "
                             "declare GRAD_TENSORS with grad_tensors() (or CHUNKED)")
        self.params = tuple({id(t): t for t in named if t.requires_grad}.values())
        self.caps, self.check = caps, STREAMED not in caps
        # no input needs a gradient: the exchange has no backward, chunks are checked in forward
        self.check_forward = torch.is_grad_enabled() and not x_like.requires_grad \
            and not self.params
        self.checked: set[int] = set()
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: list[torch.Tensor | None] = []

    def _check(self, k: int, x_leaf_ND: torch.Tensor, y_ND: torch.Tensor) -> None:
        """ValueError when chunk k's graph reaches a tensor requiring grad not differentiated."""
        if not self.check or k in self.checked:
            return
        self.checked.add(k)
        unnamed = unnamed_grad_tensors(y_ND, (x_leaf_ND, *self.params))
        if unnamed:
            which = "grad_tensors() does not return" if GRAD_TENSORS in self.caps else \
                "are not its parameters()"
            first = unnamed[0]
            raise ValueError(
                f"{type(self.experts).__name__}.forward_rows reads {len(unnamed)} tensor(s) "
                f"requiring grad that {which} (the first: {first.dtype} "
                f"{tuple(first.shape)}): under a pipelined expert-parallel exchange they would "
                "get no gradient; declare GRAD_TENSORS with grad_tensors() returning every "
                "tensor requiring grad that forward_rows reads (or CHUNKED with a chunk_runner "
                "of its own)")

    def autograd_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.params

    def _run(self, k: int, x_ND: torch.Tensor):
        with torch.enable_grad(), _autocast(self.state):
            x_leaf_ND = x_ND.detach().requires_grad_(True)
            return x_leaf_ND, self.experts.forward_rows(x_leaf_ND, self.counts[k])

    def forward(self, k: int, x_ND: torch.Tensor, keep: bool) -> torch.Tensor:
        if keep or self.check_forward:
            x_leaf_ND, y_ND = self._run(k, x_ND)
            self._check(k, x_leaf_ND, y_ND)
            if keep:
                self.kept[k] = (x_leaf_ND, y_ND)
            return y_ND.detach()
        with torch.no_grad(), _autocast(self.state):
            return self.experts.forward_rows(x_ND, self.counts[k])

    def backward(self, k, x_ND, g_ND, s_N, need_dx, need_ds):
        if k in self.kept:
            x_leaf_ND, y_ND = self.kept.pop(k)
        else:
            x_leaf_ND, y_ND = self._run(k, x_ND)
            self._check(k, x_leaf_ND, y_ND)
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
