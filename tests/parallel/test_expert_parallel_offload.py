"""Offloaded expert shards: `offload_moe` on an expert-parallel layer (static dispatcher) keeps
only this rank's experts in its store and still equals the single-process reference on real
gloo ranks: outputs, input and router gradients, every expert's gradient as accumulated in the
owning rank's store (local expert l of rank r = global expert r*L + l), and the global norm with
the expert part summed over the EP group; the simulated device stays within its budget. Host
and disk tiers. tier='auto' and the pipelined strategies that offload the hidden (S1, S3) are
refused with a ValueError; the pipelined dispatcher itself serves offloaded shards
(tests/parallel/test_pipelined_offload.py)."""

from __future__ import annotations

import pytest

from moescale.parallel.launch import run_local

from ep_offload_workers import check_offloaded_shards, refusals

pytestmark = pytest.mark.distributed


def _cases(world: int) -> list[dict]:
    E = 2 * world
    return [
        dict(name="top2 dropless", E=E, top_k=2, tokens=[9, 4, 7, 5][:world]),
        dict(name="dead experts, idle rank", E=E, top_k=2, tokens=[6, 0, 3, 1][:world],
             dead=(0, E - 2, E - 1)),
        dict(name="glu, 3 experts per rank", E=3 * world, top_k=2, tokens=[9, 4, 7, 5][:world],
             glu=True),
        dict(name="bias, top1 capacity", E=E, top_k=1, tokens=[9, 4, 7, 5][:world], bias=True,
             capacity=1.0),
    ]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,tier", [(2, "host"), (2, "disk"), (4, "host")])
def test_offloaded_shards_match_single_process_reference(world, tier, tmp_path):
    results = run_local(check_offloaded_shards, world, (_cases(world), tier, str(tmp_path)),
                        timeout_s=20, deadline_s=80)
    assert all([name for name, _ in r.value] == [c["name"] for c in _cases(world)]
               for r in results)
    for i, case in enumerate(_cases(world)):    # some rank's experts streamed through
        assert max(r.value[i][1] for r in results) > 0, case["name"]


@pytest.mark.timeout(60)
def test_auto_tier_and_hidden_offloading_strategies_are_refused():
    results = run_local(refusals, 2, (), timeout_s=20, deadline_s=50)
    for r in results:
        auto, s1 = r.value
        assert "tier='auto' plans one process's experts" in auto
        assert "strategy='S1' offloads the hidden activation" in s1
