"""Greedy LPT placement: coverage of every row, determinism, caps, affinity and splitting."""

import random

import pytest

from moescale.parallel.placement import PlacementConfig, plan_placement


def _zipf_counts(num_experts, exponent, rows, seed):
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** exponent for i in range(num_experts)]
    rng.shuffle(weights)
    counts = [0] * num_experts
    for e in rng.choices(range(num_experts), weights=weights, k=rows):
        counts[e] += 1
    return counts


def _check_covers(counts, placement, num_devices):
    rows = {}
    for s in placement.shards:
        assert 0 <= s.device < num_devices
        rows.setdefault(s.expert, []).append((s.row_start, s.row_stop, s.device))
    for e, n in enumerate(counts):
        if n == 0:
            assert e not in rows
            continue
        spans = sorted(rows[e])
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert len({d for _, _, d in spans}) == len(spans), "two shards of one expert on a device"
    loads = [0.0] * num_devices
    for s in placement.shards:
        loads[s.device] += s.row_stop - s.row_start
    assert loads == pytest.approx(placement.device_load)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("exponent", [0.0, 1.0, 1.5])
def test_every_row_is_placed_once_and_loads_add_up(split, exponent):
    counts = _zipf_counts(32, exponent, 4096, seed=3)
    counts[5] = 0
    placement = plan_placement(counts, PlacementConfig(num_devices=4, split=split))
    _check_covers(counts, placement, 4)


def test_split_to_balance_fixes_coarse_experts_with_few_more_shards():
    """8 experts on 4 devices, none above the target, but too coarse for LPT alone."""
    for seed in range(40):
        counts = _zipf_counts(8, 1.0, 2000 + 37 * seed, seed)
        plain = plan_placement(counts, PlacementConfig(num_devices=4, split=True,
                                                       balance_tol=None))
        tuned = plan_placement(counts, PlacementConfig(num_devices=4, split=True))
        _check_covers(counts, tuned, 4)
        assert len(tuned.raw_shards) <= len(plain.raw_shards) + 2 * 3
        assert tuned.imbalance <= max(1.02 + 4 / sum(counts), 1.0)
        assert tuned.imbalance <= plain.imbalance
    counts = [900, 850, 820, 100, 90, 80, 70, 60]   # LPT alone: 900 / 742.5 = 1.21
    tuned = plan_placement(counts, PlacementConfig(num_devices=4, split=True))
    assert tuned.imbalance <= 1.02


def test_same_counts_give_the_same_plan_and_ties_go_to_lower_ids():
    counts = [10] * 8
    a = plan_placement(counts, PlacementConfig(num_devices=4))
    b = plan_placement(list(counts), PlacementConfig(num_devices=4))
    assert a.raw_shards == b.raw_shards
    assert [s.device for s in a.shards[:4]] == [0, 1, 2, 3]
    assert [s.expert for s in a.shards[:4]] == [0, 1, 2, 3]


def test_lpt_beats_static_and_splitting_fixes_a_dominant_expert():
    counts = _zipf_counts(32, 1.5, 16384, seed=0)
    static = [sum(counts[d * 8:(d + 1) * 8]) for d in range(4)]
    static_imbalance = max(static) / (sum(static) / 4)
    lpt = plan_placement(counts, PlacementConfig(num_devices=4))
    split = plan_placement(counts, PlacementConfig(num_devices=4, split=True))
    assert lpt.imbalance <= static_imbalance
    # one expert holds more than a quarter of the rows: LPT alone cannot balance it
    assert max(counts) * 4 / sum(counts) > 1.15
    assert lpt.imbalance == pytest.approx(max(counts) * 4 / sum(counts))
    assert split.imbalance <= 1.05


def test_cache_cap_is_respected_and_an_impossible_cap_is_a_clear_error():
    counts = [5] * 12
    placement = plan_placement(counts, PlacementConfig(num_devices=4, max_experts_per_device=3))
    assert all(len(held) <= 3 for held in placement.experts_on_device)
    with pytest.raises(ValueError, match="max_experts_per_device=2"):
        plan_placement(counts, PlacementConfig(num_devices=4, max_experts_per_device=2))


def test_upload_cost_keeps_experts_where_they_are_resident():
    counts = [10, 10, 10, 10]
    resident = [{3}, {2}, {1}, {0}]
    placement = plan_placement(counts, PlacementConfig(num_devices=4, upload_cost=100.0),
                               resident)
    assert {s.expert: s.device for s in placement.shards} == {3: 0, 2: 1, 1: 2, 0: 3}


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="num_devices=0"):
        PlacementConfig(num_devices=0)
    with pytest.raises(ValueError, match="resident has 1 entries"):
        plan_placement([1, 2], PlacementConfig(num_devices=2), [set()])


def test_fast_paths_agree_with_the_general_greedy():
    """The no-cap/no-affinity fast loops give the general greedy's placement exactly."""
    import math

    from moescale.parallel import placement as pl

    for seed in range(60):
        counts = _zipf_counts(32, [0.0, 1.0, 1.5, 3.0][seed % 4], 40 * (seed % 7), seed)
        for split in (False, True):
            cfg = PlacementConfig(num_devices=1 + seed % 8, split=split, row_cost=1.5,
                                  balance_tol=None)
            fast = plan_placement(counts, cfg)
            order = sorted(range(32), key=lambda e: (-counts[e], e))
            items = [(counts[e], e, 0, counts[e]) for e in order if counts[e] > 0]
            target = sum(counts) / cfg.num_devices
            if split and items and items[0][0] > target:
                items = pl._split_items(items, target, cfg.num_devices)
            slow = pl._greedy(items, counts, cfg, None)
            assert fast.raw_shards == slow.raw_shards
            assert all(math.isclose(a, b) for a, b in zip(fast.device_load, slow.device_load))
    # an upload cost without resident sets is a fixed cost per placed shard (general path)
    counts = [5, 3, 0, 9, 1]
    placed = plan_placement(counts, PlacementConfig(num_devices=2, upload_cost=10.0))
    assert sum(placed.device_load) == pytest.approx(sum(counts) + 10.0 * 4)
