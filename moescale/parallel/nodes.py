"""Dynamic placement across nodes: the node layout and the inter-node expert-gradient average.

The world of W = N x L ranks is N nodes of L consecutive ranks (torchrun's node-major order:
rank r = node * L + local). Within a node, the L ranks share one host copy of the experts (the
node's store in /dev/shm) and place them dynamically (the DynamicPlacementDispatcher over the
node group). Across nodes, every node holds a full replica of the experts; the replicas stay
equal because every node steps them with the same gradients, the same clipping coefficient and
the same AdamW math.

`node_layout(world, rank, node_size, env)` derives (and validates) the layout: `node_size` 0
means "the ranks of this machine" (LOCAL_WORLD_SIZE); a smaller value cuts each machine into
virtual nodes of `node_size` ranks, each with its own store (so several nodes can be emulated
on one machine). A virtual node never spans machines: its store is a local file.

Gradient scale (`average_across_nodes`): each rank back-propagates the mean loss over its own
tokens; the dispatcher's group is the node, so the return all-to-all's backward scales by 1/L
and a node's store accumulates d(mean of its L ranks' losses)/dtheta. With equal token counts
per rank, the model's loss (the mean over all N x L ranks) is the mean over the nodes of the
node means, so the expert gradient is (1/N) x the sum over nodes of the node accumulators:
one sum all-reduce over the inter-node group (the ranks with the same local rank) and a
division by N. Each local rank reduces a disjoint share of the experts (the k-th (layer,
expert) pair, layers in order and experts ascending, goes to local rank k % L), so the node's
L ranks reduce in parallel and no expert is sent twice. Every node ends with bitwise-equal
accumulators (the all-reduce hands every member the same sum).

Not here: the store (shared_store/node_store.py), the per-node placement and experts
(dynamic.py, shared_store/experts.py), the trainer's use of all this (train/exchange.py,
shared_store/step.py). Nodes with different numbers of ranks are not supported.

Legend: E experts of a layer, P parameters of one expert, N nodes, L ranks per node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moescale.parallel.all_to_all import collective_errors


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits: N nodes of L ranks; rank = node * L + local_rank."""

    num_nodes: int
    node_size: int
    node: int
    local_rank: int


def node_layout(world: int, rank: int, node_size: int = 0,
                env: Mapping[str, str] | None = None) -> NodeLayout:
    """The node layout of `rank` in a world of `world` ranks (see the module docstring).

    node_size 0: LOCAL_WORLD_SIZE from `env` (torchrun; the whole world when it is unset).
    Raises ValueError when the layout cannot hold: node_size not dividing the world or the
    machine's ranks, or ranks that are not numbered node-major.
    """
    env = {} if env is None else env
    machine = int(env.get("LOCAL_WORLD_SIZE", world))
    if machine < 1 or world % machine:
        raise ValueError(f"LOCAL_WORLD_SIZE={machine} does not divide the {world} ranks; "
                         "dynamic placement needs the same number of ranks on every machine")
    if "LOCAL_RANK" in env and int(env["LOCAL_RANK"]) != rank % machine:
        raise ValueError(f"rank {rank} has LOCAL_RANK={env['LOCAL_RANK']}, but node-major "
                         f"numbering (rank = node * {machine} + local rank) gives "
                         f"{rank % machine}; launch with torchrun, which numbers ranks so")
    if "GROUP_RANK" in env and int(env["GROUP_RANK"]) != rank // machine:
        raise ValueError(f"rank {rank} runs on machine GROUP_RANK={env['GROUP_RANK']}, but "
                         f"node-major numbering gives {rank // machine}; launch with torchrun, "
                         "which numbers ranks so")
    if node_size < 0:
        raise ValueError(f"parallel.node_size={node_size} is invalid: use 0 (the ranks of "
                         "each machine) or a positive number of ranks per node")
    size = node_size or machine
    if world % size:
        raise ValueError(f"parallel.node_size={node_size} does not divide the {world} ranks; "
                         f"choose a divisor of {world} (0: the {machine} ranks of a machine)")
    if machine % size:
        raise ValueError(f"parallel.node_size={node_size} does not divide the {machine} ranks "
                         f"of a machine (LOCAL_WORLD_SIZE): a node's ranks share one store in "
                         f"/dev/shm, so a node cannot span machines; choose a divisor of "
                         f"{machine} or 0")
    return NodeLayout(num_nodes=world // size, node_size=size, node=rank // size,
                      local_rank=rank % size)


def node_share(num_experts: Sequence[int], local_rank: int,
               node_size: int) -> list[tuple[int, int]]:
    """The (layer, expert) pairs whose gradient `local_rank` averages across nodes: the k-th
    pair (layers in order, experts ascending) goes to local rank k % node_size. Disjoint over
    the node's ranks, covering every expert, and the same on every node."""
    pairs = [(i, e) for i, E in enumerate(num_experts) for e in range(E)]
    return pairs[local_rank::node_size]


def average_across_nodes(layers: Sequence, layout: NodeLayout, inter_group) -> list[torch.Tensor]:
    """Average this rank's share of the node's expert-gradient accumulators over the nodes
    (in place; call after every backward of the iteration has finished on the whole world).
    `layers`: SharedStoreExperts (their `grad_rows()` are the store's [E, P] accumulators).
    Returns the share's accumulator views [P] (clipping counts and scales them: disjoint over
    the node, every expert once). A no-op reduction on one node."""
    pairs = node_share([x.num_experts for x in layers], layout.local_rank, layout.node_size)
    grads_P = [layers[i].grad_rows()[e] for i, e in pairs]
    if layout.num_nodes == 1 or not grads_P:
        return grads_P
    flat = torch.cat(grads_P)
    with collective_errors("inter-node expert-gradient all-reduce", inter_group):
        dist.all_reduce(flat, group=inter_group)
    flat.div_(layout.num_nodes)
    offset = 0
    for g_P in grads_P:
        g_P.copy_(flat[offset:offset + g_P.numel()])
        offset += g_P.numel()
    return grads_P
