"""The index math the exchanges share (moescale.dispatch.index), against brute force on
labelled rows: segment gathers, the (source, expert) -> (expert, source) reorder and a
permutation's inverse. Host only, no process group.

Legend: S rows, W source ranks, L experts per rank.
"""

from __future__ import annotations

import random

import pytest
import torch

from moescale.dispatch.index import expert_major_order, inverse_permutation, segments_index


@pytest.mark.parametrize("seed", range(8))
def test_segments_index_gathers_the_segments_in_the_order_given(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 0, 1, 3, 7]) for _ in range(rng.randrange(1, 9))]
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    order = list(range(len(lengths)))
    rng.shuffle(order)
    segments = [(starts[i], lengths[i]) for i in order]
    index_S = segments_index(segments, at, "cpu")
    want = [row for start, n in segments for row in range(start, start + n)]
    got = list(range(at)) if index_S is None else index_S.tolist()
    assert got == want
    if index_S is None:          # None only when the order given is already the identity
        assert want == list(range(at))


def test_segments_index_is_none_for_the_identity_and_skips_empty_segments():
    assert segments_index([(0, 2), (5, 0), (2, 3)], 5, "cpu") is None
    assert segments_index([], 0, "cpu") is None
    assert segments_index([(2, 3), (9, 0), (0, 2)], 5, "cpu").tolist() == [2, 3, 4, 0, 1]


@pytest.mark.parametrize("W,L,seed", [(2, 3, 0), (3, 2, 1), (4, 4, 2), (1, 5, 3), (5, 1, 4),
                                      (3, 3, 5)])
def test_expert_major_order_groups_rows_by_expert_then_source(W, L, seed):
    rng = random.Random(seed)
    recv_WL = [[rng.choice([0, 1, 2, 5]) for _ in range(L)] for _ in range(W)]
    labels = [(s, l, i) for s in range(W) for l in range(L) for i in range(recv_WL[s][l])]
    perm_S, local_counts_L = expert_major_order(recv_WL, "cpu")
    got = labels if perm_S is None else [labels[i] for i in perm_S.tolist()]
    assert got == sorted(labels, key=lambda x: (x[1], x[0], x[2]))
    assert local_counts_L == [sum(recv_WL[s][l] for s in range(W)) for l in range(L)]
    if W == 1 or L == 1:
        assert perm_S is None


def test_inverse_permutation_undoes_a_gather():
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 2, 17):
        perm_S = torch.randperm(n, generator=gen)
        x_S = torch.randn(n, 3, generator=gen)
        inv_S = inverse_permutation(perm_S)
        assert torch.equal(x_S[perm_S][inv_S], x_S)
        assert torch.equal(perm_S[inv_S], torch.arange(n))
