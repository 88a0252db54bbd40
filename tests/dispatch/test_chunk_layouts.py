"""Chunk cuts of the pipelined all-to-all (moescale.dispatch.chunk_layout; pure host arithmetic,
no processes): every row in exactly one chunk, sender and receiver agree on every chunk's split,
chunks balanced."""

import math
import random

import pytest
import torch

from moescale.dispatch.chunk_layout import chunk_layouts


def _counts(W: int, L: int, seed: int) -> list[list[list[int]]]:
    """counts[s][p][l]: rows source rank s sends to local expert l of rank p."""
    rng = random.Random(seed)
    return [[[rng.choice([0, 1, 7, 15, 16, 33]) for _ in range(L)] for _ in range(W)]
            for _ in range(W)]


@pytest.mark.parametrize("W,L,C,seed", [(2, 4, 8, 0), (4, 2, 3, 1), (3, 3, 4, 2), (2, 1, 8, 3)])
def test_chunks_cover_rows_agree_between_peers_and_balance(W, L, C, seed):
    counts = _counts(W, L, seed)
    layouts = {}
    for r in range(W):
        send = counts[r]
        recv = [counts[s][r] for s in range(W)]
        token_idx_R = torch.arange(sum(map(sum, send)))
        layouts[r] = chunk_layouts(send, recv, token_idx_R, C, r)
        rows = torch.cat([lay.row_idx for lay in layouts[r]]).tolist()
        assert sorted(rows) == list(range(len(token_idx_R)))       # no row lost or doubled
        received = sum(map(sum, recv))
        per_chunk = [lay.num_recv for lay in layouts[r]]
        assert sum(per_chunk) == received
        # the rotation spreads the bins' larger pieces: every chunk within one row of S/C
        assert max(per_chunk) <= math.ceil(received / C) + 1, per_chunk
    for k in range(C):
        for r in range(W):
            for p in range(W):
                assert layouts[r][k].send_splits[p] == layouts[p][k].recv_splits[r], (k, r, p)

