"""Dynamic placement's row layout (moescale.dispatch.placed_layout), host arithmetic only: no
process group. The ranks' all-to-alls are played out in one process on labelled rows, so the
test sees where every row lands: on the device of its shard, its expert's rows contiguous and
experts ascending, and back on its own rank in plan order after the inverse moves.

Legend: W ranks (devices), E experts, R rows a rank routed, S rows a device received.
"""

from __future__ import annotations

import random

import pytest
import torch

from moescale.dispatch.index import inverse_permutation
from moescale.dispatch.placed_layout import row_layout
from moescale.parallel.dynamic import random_placement_hook
from moescale.parallel.placement import Placement


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _random_case(trial: int):
    rng = random.Random(trial)
    W, E = rng.choice([2, 3, 4]), rng.choice([1, 3, 8])
    counts = [[rng.randrange(0, 5) for _ in range(E)] for _ in range(W)]
    total = [sum(c[e] for c in counts) for e in range(E)]
    placement = random_placement_hook(trial, W)(Placement([], [0.0] * W), total)
    return W, E, counts, placement


def test_row_layout_covers_every_row_under_a_random_placement():
    """Host-only: the send/receive splits of all ranks agree and carry every row once."""
    rng = random.Random(0)
    for trial in range(20):
        W, E = rng.choice([2, 3, 4]), rng.choice([1, 3, 8])
        counts = [[rng.randrange(0, 5) for _ in range(E)] for _ in range(W)]
        total = [sum(c[e] for c in counts) for e in range(E)]
        placement = random_placement_hook(trial, W)(Placement([], [0.0] * W), total)
        lays = [row_layout(counts, placement.raw_shards, r) for r in range(W)]
        for r in range(W):
            assert [lays[s].send_splits[r] for s in range(W)] == lays[r].recv_splits
            assert sum(lays[r].local_counts_E) == sum(lays[r].recv_splits)
            perm = lays[r].send_perm_R
            n = sum(counts[r])
            if perm is not None:
                assert sorted(perm.tolist()) == list(range(n))
            perm = lays[r].expert_perm_S
            if perm is not None:
                assert torch.equal(perm.sort().values, torch.arange(perm.numel()))


@pytest.mark.parametrize("trial", range(12))
def test_rows_reach_their_shards_device_and_come_back(trial):
    """Every row goes to the device whose shard covers its global row, grouped by ascending
    expert there (global row order inside an expert), and the inverse moves return it to its
    rank at its plan position."""
    W, E, counts, placement = _random_case(trial)
    lays = [row_layout(counts, placement.raw_shards, r) for r in range(W)]
    # a row is labelled (expert, its global row among the expert's rows of all ranks)
    labels_R = []
    for r in range(W):
        rows = []
        for e in range(E):
            first = sum(counts[s][e] for s in range(r))
            rows += [(e, first + i) for i in range(counts[r][e])]
        labels_R.append(torch.tensor(rows, dtype=torch.int64).reshape(-1, 2))
    sent = [_take(labels_R[r], lays[r].send_perm_R).split(lays[r].send_splits) for r in range(W)]
    local = [_take(torch.cat([sent[s][d] for s in range(W)]), lays[d].expert_perm_S)
             for d in range(W)]
    for d in range(W):
        want = sorted((e, row) for e, dev, a, b in placement.raw_shards if dev == d
                      for row in range(a, b))
        assert [tuple(x) for x in local[d].tolist()] == want, (trial, d)
        got_counts = [0] * E
        for e, _ in want:
            got_counts[e] += 1
        assert lays[d].local_counts_E == got_counts
    # the way back: inverse expert order, all-to-all back, inverse send order
    back = [_take(local[d], None if lays[d].expert_perm_S is None
                  else inverse_permutation(lays[d].expert_perm_S)).split(lays[d].recv_splits)
            for d in range(W)]
    for r in range(W):
        returned = torch.cat([back[d][r] for d in range(W)])
        inv = None if lays[r].send_perm_R is None else inverse_permutation(lays[r].send_perm_R)
        assert torch.equal(_take(returned, inv), labels_R[r]), (trial, r)
    # owners: the device of each expert's first rows; split: experts on several devices
    for e in range(E):
        on = {dev for x, dev, a, b in placement.raw_shards if x == e}
        first = [dev for x, dev, a, b in placement.raw_shards if x == e and a == 0]
        assert all(lay.owners_E[e] == (first[0] if first else -1) for lay in lays)
        assert all((e in lay.split_experts) == (len(on) > 1) for lay in lays)


def test_a_placement_that_misses_rows_or_devices_is_refused():
    counts = [[2, 1], [0, 3]]
    with pytest.raises(ValueError, match="every row needs exactly one shard"):
        row_layout(counts, [(0, 0, 0, 2), (1, 1, 0, 3)], 0)       # expert 1 has 4 rows
    with pytest.raises(ValueError, match="on device 2; the group has 2"):
        row_layout(counts, [(0, 2, 0, 2), (1, 1, 0, 4)], 0)


def test_identity_placement_moves_nothing():
    """One device holding every expert: no permutation on either side."""
    lay = row_layout([[3, 0, 2]], [(0, 0, 0, 3), (2, 0, 0, 2)], 0)
    assert lay.send_perm_R is None and lay.expert_perm_S is None
    assert (lay.send_splits, lay.recv_splits, lay.local_counts_E) == ([5], [5], [3, 0, 2])
    assert lay.owners_E == [0, -1, 0] and lay.split_experts == []
