"""Expert parallelism on real gloo ranks against the single-process reference.

Each run_local call starts W real processes (forked from a torch-preloaded fork server) and
runs many cases in them; every rank checks its output and all gradients itself
(tests/parallel/ep_workers.py). Covered: the static and the pipelined dispatcher (chunks 1, 2,
3, 4, 8; strategies none and S1-S4; cost-model pick), the primitives and the torchrun
environment, the online tuner, DDP, builders and state dicts, bf16 autocast, 20 training steps
of the default GPT, groups validation, and failure (not hang) when a peer dies or stalls.
"""

from __future__ import annotations

import statistics

import pytest

from moescale.parallel.groups import ParallelConfig, split_ranks
from moescale.parallel.launch import run_local

from ep_workers import (check_against_reference, check_ddp_and_builders, check_primitives,
                        check_tuner, die_or_dispatch, train_gpt)

pytestmark = pytest.mark.distributed


def _cases(world: int) -> list[dict]:
    E = 2 * world
    full = [9, 4, 7, 5][:world]
    uneven = [6, 0, 3, 1][:world]
    last_rank_experts = tuple(range(E - 2, E))
    return [
        dict(name="top2 dropless", E=E, top_k=2, tokens=full, clip=True),
        dict(name="top1 dropless", E=E, top_k=1, tokens=full),
        dict(name="top2 capacity", E=E, top_k=2, tokens=full, capacity=0.75),
        dict(name="top1 capacity", E=E, top_k=1, tokens=full, capacity=1.0),
        dict(name="dead experts, idle rank, uneven tokens", E=E, top_k=2, tokens=uneven,
             dead=(0,) + last_rank_experts),
        dict(name="no tokens anywhere", E=E, top_k=2, tokens=[0] * world),
        dict(name="glu, 3 experts per rank", E=3 * world, top_k=2, tokens=full, glu=True),
        dict(name="bias, 1 expert per rank", E=world, top_k=1, tokens=full, bias=True),
        dict(name="module experts", E=E, top_k=2, tokens=uneven, module_experts=True,
             capacity=1.0),
    ]


def test_split_ranks_and_config_errors():
    assert split_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert split_ranks(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="ep_size=3 must divide the world size 4"):
        split_ranks(4, 3)
    with pytest.raises(ValueError, match="ep_size=0"):
        ParallelConfig(ep_size=0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        ParallelConfig(backend="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        ParallelConfig(timeout_s=0)
    with pytest.raises(ValueError, match="chunks=0"):
        ParallelConfig(chunks=0)
    with pytest.raises(ValueError, match="reuse='S5'"):
        ParallelConfig(reuse="S5")
    assert ParallelConfig().resolved_backend() in ("gloo", "nccl")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,ep_size", [  # the fast lane keeps 2 ranks
    (2, None), pytest.param(4, None, marks=pytest.mark.slow),
    pytest.param(4, 2, marks=pytest.mark.slow)])
def test_matches_single_process_reference(world, ep_size):
    results = run_local(check_against_reference, world, (_cases(world), ep_size),
                        timeout_s=20, deadline_s=80)
    assert all(len(r.value) == len(_cases(world)) for r in results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["die", pytest.param("stall", marks=pytest.mark.slow)])
def test_dead_or_stalled_rank_fails_fast(mode):
    timeout_s = 3.0
    results = run_local(die_or_dispatch, 2, (mode, timeout_s), timeout_s=timeout_s,
                        deadline_s=40, raise_on_error=False)
    outcome = results[0].value
    assert results[0].ok, results[0].error
    assert outcome[0] == "raised", outcome
    assert "expert-parallel" in outcome[1] and "rank 0" in outcome[1], outcome[1]
    assert outcome[2] < timeout_s + 10, outcome
    if mode == "die":
        assert results[1].exitcode == 7


def _pipeline_cases(world: int) -> list[dict]:
    E = 2 * world
    tokens = [9, 4, 7, 5][:world]       # bins of 0..9 rows: most not divisible by the chunks
    cases = []
    for chunks in (1, 2, 3, 4, 8):
        for strategy in ("none", "S1", "S2", "S3", "S4"):
            cases.append(dict(name=f"chunks={chunks} {strategy}", E=E, top_k=2, tokens=tokens,
                              chunks=chunks, strategy=strategy, glu=chunks == 3))
    cases += [
        dict(name="pipeline top1 capacity", E=E, top_k=1, tokens=tokens, capacity=1.0,
             chunks=3, strategy="S4"),
        dict(name="pipeline idle rank", E=E, top_k=2, tokens=[6, 0, 3, 1][:world],
             dead=(0, E - 2, E - 1), chunks=4, strategy="S2", bias=True),
        dict(name="pipeline 1 expert per rank", E=world, top_k=1, tokens=tokens, chunks=2,
             strategy="S3"),
        dict(name="module experts pipelined, none", E=E, top_k=2, tokens=tokens,
             module_experts=True, chunks=3, strategy="none"),
        dict(name="module experts pipelined, S2, capacity", E=E, top_k=2, tokens=tokens,
             module_experts=True, chunks=4, strategy="S2", capacity=1.0),
        dict(name="module experts pipelined, S4, idle rank", E=E, top_k=2,
             tokens=[6, 0, 3, 1][:world], module_experts=True, chunks=2, strategy="S4",
             dead=(0, E - 2, E - 1)),
        # the per-rank peak formula at 4 chunks, 9 tokens of top-2, D 8, F 12, 2 local experts:
        # none 4576 bytes, S2 / S4 3888, S3 4464, the unpipelined dispatcher 5472
        dict(name="cost model picks a reuse strategy under a tiny limit", E=E, top_k=2,
             tokens=tokens, chunks=4, strategy="auto", memory_limit=4000,
             allowed=("S2", "S4")),
    ]
    return cases


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pipelined_matches_reference(world):
    cases = _pipeline_cases(world)
    results = run_local(check_against_reference, world, (cases, None), timeout_s=20,
                        deadline_s=110)
    assert all(len(r.value) == len(cases) for r in results)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_pipelined_with_expert_replicas():
    """4 ranks = 2 EP groups x 2 replicas: the pipeline runs on the EP subgroups, expert grads
    are averaged over the replicas."""
    tokens = [9, 4, 7, 5]
    cases = [dict(name="replicas S4", E=4, top_k=2, tokens=tokens, chunks=3, strategy="S4"),
             dict(name="replicas S1 glu", E=6, top_k=2, tokens=tokens, chunks=2,
                  strategy="S1", glu=True, clip=True),
             dict(name="replicas modules S2", E=4, top_k=1, tokens=tokens, chunks=4,
                  strategy="S2", module_experts=True)]
    results = run_local(check_against_reference, 4, (cases, 2), timeout_s=20, deadline_s=50)
    assert all(len(r.value) == len(cases) for r in results)


@pytest.mark.timeout(60)
def test_primitives_and_torchrun_environment():
    results = run_local(check_primitives, 3, init_group=False, timeout_s=20, deadline_s=50)
    errors = results[0].value
    assert "num_experts=7 must be a positive multiple of the expert-parallel size 3" in errors[0]
    assert "strategy='S1' offloads the hidden activation" in errors[1]
    assert "hold 6 experts on this rank but expert parallelism over 3 ranks puts 2" in errors[2]


@pytest.mark.timeout(60)
def test_online_tuner_same_choice_on_every_rank():
    results = run_local(check_tuner, 2, (8,), timeout_s=20, deadline_s=50)
    (hist0, samples0, strat0), (hist1, samples1, strat1) = results[0].value, results[1].value
    assert hist0 == hist1 and samples0 == samples1 and strat0 == strat1   # (and each pick's
    # peak was at most the unpipelined dispatcher's: checked on the ranks)
    for bucket in {b for b, _ in hist0}:
        chosen = [c for b, c in hist0 if b == bucket]
        assert chosen[:3] == [1, 2, 4][:len(chosen)]   # explores, 1 included, then exploits
        if len(chosen) > 3:
            best = min((1, 2, 4), key=lambda c: (statistics.median(samples0[bucket][c]), c))
            assert set(chosen[3:]) == {best}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipelined,steps", [pytest.param(False, 20, marks=pytest.mark.slow),
                                             (True, 3)])
def test_two_rank_training_matches_single_process(pipelined, steps):
    results = run_local(train_gpt, 2, (steps, pipelined), timeout_s=30, deadline_s=110)
    for rank_result in results:
        for step, (single, ep, norm_single, norm_ep) in enumerate(rank_result.value):
            assert abs(single - ep) <= 1e-5 * max(1.0, abs(single)), (step, single, ep)
            assert abs(norm_single - norm_ep) <= 1e-4 * max(1.0, norm_single), (step,)


@pytest.mark.timeout(60)
def test_ddp_builders_and_autocast():
    run_local(check_ddp_and_builders, 2, timeout_s=20, deadline_s=50)
