"""`moescale train --parallel.placement dynamic` across nodes: 4 gloo ranks as 2 virtual nodes
of 2 (`parallel.node_size 2`; real processes, one /dev/shm store per node).

Within a node the 2 ranks share a store and place experts by LPT; across the nodes the experts
are replicas whose gradients are averaged before the step. Checked: 20 steps give the
single-process losses, validation losses, grad norms and routed counts (fp32 tolerance); at
the end the two nodes' stores hold bitwise-equal expert masters, AdamW moments and step
counts (and the stores differ from the initial experts, so the check can fail); every step
logs the modelled load over all 4 devices; the consolidated checkpoint of the 2 x 2 run
resumes in one process, and a single-process checkpoint on 2 x 2, with the uninterrupted
losses; the 4 ranks of `torchrun --nnodes 2 --nproc-per-node 2` on two machines (node_size 0)
give the single-process losses too; bad node layouts are ValueErrors that
name the fix (node_layout on its own, through check_launch, and the config)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moescale.parallel.launch import run_local
from moescale.parallel.nodes import node_layout, node_share
from moescale.train.assembly import check_parts
from moescale.shared_store.node_store import shm_directory
from moescale.train.exchange import check_launch
from moescale.train.config import load_config, to_dict
from moescale.train.metrics import read_metrics
from moescale.train.trainer import Trainer
from train_helpers import (TINY, assert_same_run, continue_run, run_records, small_corpus,
                           torchrun_train)

pytestmark = pytest.mark.distributed

STEPS = 20
OPTIONS = dict(TINY, **{"train.steps": str(STEPS), "train.eval_interval": "10",
                        "train.checkpoint_interval": "10", "train.keep_last": "2"})

NODES = {"parallel.placement": "dynamic", "parallel.node_size": "2", "train.device": "cpu"}


def _train_rank(rank: int, world: int, tree: dict, run_dir: str):
    """Train on this rank; local rank 0 of each node returns its store's final state."""
    config = load_config(None, None, base=tree)
    trainer = Trainer(config, run_dir, out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    code = trainer.run()
    backend = trainer.parts.exchange
    if backend.layout.local_rank != 0:
        return code, None, None
    layers = trainer.parts.residency.layers     # the node store's experts (the residency's)
    state = [x.store.shared_state()[x.layer_index] for x in layers]
    return code, backend.layout.node, [(d.clone().numpy(), s.clone().numpy()) for d, s in state]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    options = dict(OPTIONS, **{"train.device": "cpu",
                               "data.path": str(small_corpus(root / "corpus"))})
    single = root / "single"
    config = load_config(None, dict(options, **{"train.run_dir": str(single)}))
    trainer = Trainer(config, single, out=open(os.devnull, "w"))
    initial = [moe.experts.w1_EDF.detach().clone() for moe in trainer.model.modules()
               if hasattr(moe, "router")]
    assert trainer.run() == 0
    nodes = root / "nodes"
    config = load_config(None, dict(options, **NODES, **{"train.run_dir": str(nodes)}))
    results = run_local(_train_rank, 4, (to_dict(config), str(nodes)), timeout_s=60,
                        deadline_s=150)
    assert [r.value[0] for r in results] == [0] * 4
    stores = {r.value[1]: r.value[2] for r in results if r.value[1] is not None}
    return single, nodes, stores, initial, options


@pytest.mark.timeout(200)
def test_two_nodes_of_two_equal_single_process(runs):
    single, nodes, *_ = runs
    assert_same_run(run_records(nodes), run_records(single))
    train = [r for r in read_metrics(nodes / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == STEPS
    for r in train:       # the mean over all 4 devices of both nodes; the busiest node's max
        assert r["device_load_mean"] == pytest.approx(sum(map(sum, r["tokens_per_expert"])) / 4)
        assert r["device_load_max"] >= r["device_load_mean"] > 0


def test_the_nodes_replicas_stay_bitwise_equal(runs):
    _, _, stores, initial, _ = runs
    assert sorted(stores) == [0, 1]
    for (data0, steps0), (data1, steps1) in zip(stores[0], stores[1]):
        assert np.array_equal(data0.view(np.int32), data1.view(np.int32))   # bit patterns
        assert np.array_equal(steps0, steps1) and (steps0 == STEPS).all()
        assert not data0[:, 1].any()       # gradient accumulators zeroed after the last step
    first = torch.from_numpy(stores[0][0][0][:, 0])     # layer 0's masters [E, P]
    w1 = initial[0].reshape(first.shape[0], -1)
    assert not torch.equal(first[:, :w1.shape[1]], w1)  # the experts did train


@pytest.mark.timeout(120)
def test_the_two_node_checkpoint_resumes_in_one_process(runs, tmp_path):
    single, nodes, *_ = runs
    got = continue_run(nodes, tmp_path / "to_one", {"parallel.placement": "static",
                                                    "parallel.node_size": "0"}, 1, STEPS // 2)
    assert_same_run(got, run_records(single), first_step=STEPS // 2)


@pytest.mark.timeout(120)
def test_a_single_process_checkpoint_resumes_on_two_nodes(runs, tmp_path):
    """Every node's local rank 0 writes the restored experts and moments into its store."""
    single, *_ = runs
    got = continue_run(single, tmp_path / "to_nodes", NODES, 4, STEPS // 2)
    assert_same_run(got, run_records(single), first_step=STEPS // 2)


@pytest.mark.timeout(150)
def test_torchrun_on_two_machines(runs, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 -m moescale train` as the two machines (node_size
    0: LOCAL_WORLD_SIZE, numbering checked against GROUP_RANK / LOCAL_RANK): the 4 ranks forked
    with the variables torchrun's two agents give their workers (tests/warm_runner.py; checked
    against a real torchrun's in tests/parallel/test_torchrun.py)."""
    single, _, _, _, options = runs
    before = {n for n in os.listdir(shm_directory()) if n.startswith("moescale-store-")}
    output = torchrun_train(dict(options, **{"parallel.placement": "dynamic",
                                             "train.run_dir": str(tmp_path / "run")}),
                            tmp_path, 120, nodes=2)
    assert "2 local ranks on each of 2 nodes" in output
    assert_same_run(run_records(tmp_path / "run"), run_records(single))
    assert {n for n in os.listdir(shm_directory()) if n.startswith("moescale-store-")} == before


@pytest.mark.parametrize("world, node_size, env, match", [
    (4, 3, {}, "does not divide the 4 ranks"),
    (4, 4, {"LOCAL_WORLD_SIZE": "2"}, "cannot span machines"),
    (6, 0, {"LOCAL_WORLD_SIZE": "4"}, "same number of ranks on every machine"),
    (4, 0, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "node-major"),   # rank 1
    (4, 0, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, "node-major"),
    (4, -1, {}, "node_size=-1"),
])
def test_bad_node_layouts_are_value_errors(world, node_size, env, match):
    with pytest.raises(ValueError, match=match):
        node_layout(world, 1, node_size, env)


def test_node_layouts_and_shares():
    assert node_layout(8, 5, 2, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == \
        node_layout(8, 5, 2)
    lay = node_layout(8, 5, 0, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert (lay.num_nodes, lay.node_size, lay.node, lay.local_rank) == (2, 4, 1, 1)
    lay = node_layout(8, 5, 2, {"LOCAL_WORLD_SIZE": "8"})
    assert (lay.num_nodes, lay.node_size, lay.node, lay.local_rank) == (4, 2, 2, 1)
    shares = [node_share([3, 4], r, 3) for r in range(3)]
    assert sorted(p for s in shares for p in s) == [(i, e) for i, E in enumerate([3, 4])
                                                    for e in range(E)]
    assert [len(s) for s in shares] == [3, 2, 2]


def test_check_launch_refuses_a_bad_node_size(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = load_config(None, dict(NODES, **{"parallel.node_size": "3"}))
    with pytest.raises(ValueError, match="node_size=3 does not divide the 4 ranks"):
        check_launch(config)
    with pytest.raises(ValueError, match="parallel.node_size"):
        check_parts(load_config(None, {"parallel.node_size": "2"}))   # static placement
    with pytest.raises(ValueError, match="node_size"):
        load_config(None, {"parallel.placement": "dynamic", "parallel.node_size": "-2"})
