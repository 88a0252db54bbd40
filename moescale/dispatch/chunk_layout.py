"""Chunk layouts of the pipelined all-to-all: which rows each chunk sends and receives.

Chunks are cut inside every (peer, expert) bin: a bin of n rows is cut into C pieces, piece j
= rows [n*j//C, n*(j+1)//C), and chunk k takes piece (k + s*L + l) mod C of the bin that source
rank s sends to local expert l. The rotation spreads the bins' larger pieces over the chunks, so
each chunk receives ceil(S/C) rows give or take one (without it, chunk C-1 would take the larger
piece of every bin: up to S/C + W*L rows). Sender and receiver know n (the counts exchange) and
(s, l), so both compute the same cuts: no padding, no extra messages, one exchange per chunk and
direction.

Pure host arithmetic plus a few index tensors (moescale.dispatch.index); nothing here
communicates or computes experts: the pipelined exchange (moescale.parallel.pipeline) runs
the chunks, its `PipelineSpec` (moescale.parallel.pipeline_schedule) carries the layouts.

Legend: R rows sent (grouped by global expert), S rows received in one chunk, W ranks of the
EP group, L experts per rank, C chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moescale.dispatch.index import expert_major_order, inverse_permutation, segments_index


def _cut(n: int, k: int, num_chunks: int, rotation: int) -> tuple[int, int]:
    """Rows [lo, hi) of an n-row bin that chunk k takes (its piece (k + rotation) mod C)."""
    j = (k + rotation) % num_chunks
    return n * j // num_chunks, n * (j + 1) // num_chunks


def _piece(n: int, k: int, num_chunks: int, rotation: int) -> int:
    lo, hi = _cut(n, k, num_chunks, rotation)
    return hi - lo


@dataclass
class ChunkLayout:
    """One chunk: what this rank sends (rows of the plan, their tokens) and receives."""

    send_splits: list[int]
    recv_splits: list[int]
    row_idx: torch.Tensor            # positions in the plan's row order (R) of the sent rows
    token_idx: torch.Tensor          # their tokens
    perm: torch.Tensor | None        # received (source-major) -> expert-major
    inv_perm: torch.Tensor | None
    local_counts: list[int]          # rows per local expert in this chunk

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)


def chunk_layouts(send_WL: list[list[int]], recv_WL: list[list[int]],
                  token_idx_R: torch.Tensor, num_chunks: int, rank: int) -> list[ChunkLayout]:
    """Cut every (peer, expert) bin into num_chunks pieces (no padding); `rank` is this rank's
    index in the EP group (the bins it sends are (rank, l) to their receivers)."""
    device = token_idx_R.device
    W, L = len(send_WL), len(send_WL[0])
    offsets, off = {}, 0
    for p in range(W):
        for l in range(L):
            offsets[p, l] = off
            off += send_WL[p][l]
    layouts = []
    for k in range(num_chunks):
        starts, lengths, send_splits = [], [], []
        for p in range(W):
            sent = 0
            for l in range(L):
                lo, hi = _cut(send_WL[p][l], k, num_chunks, rank * L + l)
                starts.append(offsets[p, l] + lo)
                lengths.append(hi - lo)
                sent += hi - lo
            send_splits.append(sent)
        recv_piece_WL = [[_piece(recv_WL[s][l], k, num_chunks, s * L + l) for l in range(L)]
                         for s in range(W)]
        row_idx = segments_index(list(zip(starts, lengths)), sum(lengths), device)
        if row_idx is None:
            row_idx = torch.arange(sum(lengths), device=device)
        perm, local_counts = expert_major_order(recv_piece_WL, device)
        layouts.append(ChunkLayout(
            send_splits=send_splits, recv_splits=[sum(r) for r in recv_piece_WL],
            row_idx=row_idx, token_idx=token_idx_R.index_select(0, row_idx), perm=perm,
            inv_perm=None if perm is None else inverse_permutation(perm),
            local_counts=local_counts))
    return layouts
