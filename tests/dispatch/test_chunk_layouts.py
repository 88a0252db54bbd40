"""Chunk cuts of the pipelined all-to-all (moescale.dispatch.chunk_layout; pure host arithmetic,
no processes): every row in exactly one chunk, sender and receiver agree on every chunk's split,
chunks balanced, and every row reaches its expert in expert-major order."""

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


@pytest.mark.parametrize("W,L,C,seed", [(2, 4, 8, 0), (4, 2, 3, 1), (3, 3, 4, 2), (2, 1, 8, 3)])
def test_every_row_reaches_its_expert_once_in_expert_major_order(W, L, C, seed):
    """The chunked all-to-all played out in one process on labelled rows (source rank, plan
    position): over the C chunks every rank receives each row sent to it exactly once, each
    chunk's rows after `perm` are grouped by local expert as `local_counts` says, sources
    ascending within an expert, and `inv_perm` restores the received order."""
    counts = _counts(W, L, seed)
    layouts, expert_of = {}, {}
    for r in range(W):
        send = counts[r]
        recv = [counts[s][r] for s in range(W)]
        layouts[r] = chunk_layouts(send, recv, torch.arange(sum(map(sum, send))), C, r)
        expert_of[r] = [(p, l) for p in range(W) for l in range(L) for _ in range(send[p][l])]
    for p in range(W):
        seen = []
        for k in range(C):
            received = []
            for s in range(W):
                rows = layouts[s][k].row_idx.split(layouts[s][k].send_splits)[p].tolist()
                received += [(s, i) for i in rows]
            lay = layouts[p][k]
            local = received if lay.perm is None else [received[i] for i in lay.perm.tolist()]
            at = 0
            for l, n in enumerate(lay.local_counts):
                group = local[at:at + n]
                assert all(expert_of[s][i] == (p, l) for s, i in group), (k, p, l)
                assert [s for s, _ in group] == sorted(s for s, _ in group)
                at += n
            assert at == len(local) == lay.num_recv
            if lay.perm is not None:
                assert [local[i] for i in lay.inv_perm.tolist()] == received
            seen += received
        want = [(s, i) for s in range(W) for i, (q, _) in enumerate(expert_of[s]) if q == p]
        assert sorted(seen) == want
