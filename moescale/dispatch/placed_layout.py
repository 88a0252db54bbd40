"""Dynamic placement's row layout: where each rank's rows go under one iteration's placement.

A placement is a list of shards (expert e, device d, rows [a, b)) that cover every routed row
of every expert once (moescale.parallel.placement plans it; any list that covers works). The
global rows of expert e are ordered (source rank, the source's row order), so a shard's rows
are a run of each source's rows of e. From the ranks' per-expert counts (counts_WE, the same on
every rank after one all-gather) and the shards, every rank computes every send and receive
split without another exchange:

  send      this rank's rows permuted into (destination device, shard) order
  receive   blocks arrive (source rank, shard)-major; reordered to (shard, source): each
            expert's rows contiguous, experts ascending (what forward_rows expects)
  owners    the device of each expert's first rows accumulates and steps it; experts with
            shards on more than one device are `split_experts`

Pure host arithmetic plus two index tensors (moescale.dispatch.index); the exchange itself is
moescale.parallel.dynamic's.

Legend: W ranks (devices) of the group, E experts, R rows this rank routed, S rows received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moescale.dispatch.index import segments_index


@dataclass
class RowLayout:
    """How this rank's rows move in one call (host lists and index tensors)."""

    send_perm_R: torch.Tensor | None    # x_sent = x_RD[send_perm_R] (None: identity)
    send_splits: list[int]
    recv_splits: list[int]
    expert_perm_S: torch.Tensor | None  # x_local = x_recv[expert_perm_S] (None: identity)
    local_counts_E: list[int]           # rows per expert on this device (ascending expert)
    owners_E: list[int]                 # the device that owns (accumulates, steps) each expert
    split_experts: list[int]            # experts with shards on more than one device


def row_layout(counts_WE: list[list[int]], shards: Sequence[tuple[int, int, int, int]],
               rank: int, device=None) -> RowLayout:
    """The permutations and splits for `rank` when (expert e, device d, rows a, b) `shards`
    (a placement's raw_shards) cover every routed row once (same answer on every rank)."""
    W, E = len(counts_WE), len(counts_WE[0])
    total_E = [sum(counts_WE[s][e] for s in range(W)) for e in range(E)]
    work: list[list[tuple[int, int, int]]] = [[] for _ in range(W)]
    covered = [0] * E
    devices_of: list[set[int]] = [set() for _ in range(E)]
    for e, d, a, b in shards:
        if not 0 <= d < W:
            raise ValueError(f"the placement puts expert {e} on device {d}; the group has {W}")
        work[d].append((e, a, b))
        covered[e] += b - a
        devices_of[e].add(d)
    if covered != total_E:
        raise ValueError(f"the placement covers {covered} rows per expert but the ranks "
                         f"routed {total_E}; every row needs exactly one shard")
    for device_shards in work:
        device_shards.sort()   # ascending expert, then row start: experts contiguous on the device
    offset_WE = [[0] * E for _ in range(W)]   # global row of expert e where source s starts
    for e in range(E):
        acc = 0
        for s in range(W):
            offset_WE[s][e] = acc
            acc += counts_WE[s][e]

    def piece(s: int, e: int, a: int, b: int) -> tuple[int, int]:
        """(first row within source s's rows of e, number of rows) of shard [a, b) of e."""
        lo, hi = max(a, offset_WE[s][e]), min(b, offset_WE[s][e] + counts_WE[s][e])
        return lo - offset_WE[s][e], max(0, hi - lo)

    plan_start_E, acc = [], 0          # where expert e's rows begin in this rank's plan
    for e in range(E):
        plan_start_E.append(acc)
        acc += counts_WE[rank][e]
    send_segments, send_splits = [], []
    for d in range(W):
        n_d = 0
        for e, a, b in work[d]:
            first, n = piece(rank, e, a, b)
            send_segments.append((plan_start_E[e] + first, n))
            n_d += n
        send_splits.append(n_d)
    recv_n = [[piece(s, e, a, b)[1] for (e, a, b) in work[rank]] for s in range(W)]
    recv_splits = [sum(row) for row in recv_n]
    block_start, acc = {}, 0            # received layout: (source, shard)-major
    for s in range(W):
        for j, n in enumerate(recv_n[s]):
            block_start[s, j] = acc
            acc += n
    local_segments, local_counts_E = [], [0] * E
    for j, (e, _, _) in enumerate(work[rank]):   # wanted: (shard, source)-major
        for s in range(W):
            local_segments.append((block_start[s, j], recv_n[s][j]))
            local_counts_E[e] += recv_n[s][j]
    owners_E = [-1] * E
    for e, d, a, _ in shards:
        if a == 0:
            owners_E[e] = d    # the device of the shard holding the expert's first rows
    split = [e for e in range(E) if len(devices_of[e]) > 1]
    return RowLayout(
        send_perm_R=segments_index(send_segments, sum(send_splits), device),
        send_splits=send_splits, recv_splits=recv_splits,
        expert_perm_S=segments_index(local_segments, sum(recv_splits), device),
        local_counts_E=local_counts_E, owners_E=owners_E, split_experts=split)
