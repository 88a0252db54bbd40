"""Sharded expert checkpoints on real gloo ranks: saved by 2 expert-parallel ranks (each its
own experts, resident with AdamW state in the torch optimizer, or offloaded to a host or disk
store), loaded by 1 process and by 2 ranks (and a single-process save by 2 ranks), into the
same or another residency; and the dynamic-placement store shared by 2 ranks (each saves and
loads its block of every layer). Every held expert's master, moments and step equal the consolidated
reference exactly (the ranks' states gathered; for resident EP also checked against
`full_state_dict`), and the step after the resume has the uninterrupted run's loss."""

from __future__ import annotations

import pytest

from moescale.parallel.launch import run_local

from shard_workers import load_and_check, train_and_save

pytestmark = pytest.mark.distributed
STEPS = 2


def _save(world: int, tier, directory: str):
    results = run_local(train_and_save, world, (tier, directory, STEPS), timeout_s=20,
                        deadline_s=60)
    entries = [r.value[0] for r in results]
    return entries, results[0].value[1]


def _load(world: int, tiers, directory: str, entries, after: float) -> None:
    results = run_local(load_and_check, world, (tiers, directory, entries, STEPS),
                        timeout_s=20, deadline_s=60)
    for tier, loss in zip(tiers, results[0].value):
        assert abs(loss - after) <= 1e-5 * abs(after), (tier, loss, after)


@pytest.mark.timeout(150)
def test_resident_ep_shards_resume_at_one_and_two_ranks(tmp_path):
    entries, after = _save(2, None, str(tmp_path))
    assert [sorted(e["experts"].values()) for e in entries] == \
        [[[[0, 2]], [[0, 2]]], [[[2, 4]], [[2, 4]]]]          # each rank its own experts
    _load(1, [None, "disk"], str(tmp_path), entries, after)
    _load(2, [None, "host"], str(tmp_path), entries, after)


@pytest.mark.timeout(120)
def test_single_process_shards_resume_on_two_ranks(tmp_path):
    entries, after = _save(1, None, str(tmp_path))
    _load(2, [None, "disk"], str(tmp_path), entries, after)


@pytest.mark.timeout(150)
def test_disk_tier_shards_resume_at_one_and_two_ranks(tmp_path):
    entries, after = _save(2, "disk", str(tmp_path))
    shard = tmp_path / entries[1]["path"]
    linked = sorted(p.name for p in (shard / "layer000").iterdir())
    assert linked == ["expert00002.bin", "expert00003.bin"]    # global ids, hard links
    assert not (shard / "experts.safetensors").exists()
    _load(1, ["disk", None], str(tmp_path), entries, after)
    _load(2, ["disk", "host"], str(tmp_path), entries, after)


@pytest.mark.timeout(120)
def test_host_tier_shards_resume_in_one_process(tmp_path):
    entries, after = _save(2, "host", str(tmp_path))
    _load(1, ["host", None], str(tmp_path), entries, after)


@pytest.mark.timeout(150)
def test_dynamic_store_shards_resume_in_one_process_and_on_two_ranks(tmp_path):
    entries, after = _save(2, "dynamic", str(tmp_path))
    assert [sorted(e["experts"].values()) for e in entries] == \
        [[[[0, 2]], [[0, 2]]], [[[2, 4]], [[2, 4]]]]          # each rank its block
    _load(1, [None, "host"], str(tmp_path), entries, after)
    _load(2, ["dynamic", None], str(tmp_path), entries, after)
