"""Every exchange with every residency trains the single-process resident run, and resumes.

One parametrized set-up matrix: exchange {single process, static expert parallelism,
pipelined expert parallelism with 2 chunks and with chunks=auto (reuse auto), dynamic
placement, static expert parallelism with the dense half sharded (parallel.dense shard: its
checkpoint's dense half saved whole, resumed on one process)} x residency {resident, host tier, disk tier}. Each cell trains 20 AdamW steps (2
gloo ranks, real processes; the single-process row on one) and must log the losses,
validation losses, grad norms and routed token counts of single-process resident training
(losses within 1e-5 relative, grad norms 1e-4; static EP with offloaded experts 1e-5); then its
step-10 checkpoint is resumed at the other rank count (2-rank cells on one process with the same
residency, the single-process row on 2 expert-parallel ranks) and must log the same losses
again. A cell whose parts refuse the
combination must say so with one clear line (the test then checks that refusal instead).

Each cell also checks what its run left behind (_check_outputs): the checkpoint's dense half
has the single-process keys and values (no expert in it; resident cells: the optimizer state
too), every rank wrote a shard of its own disjoint experts, offloaded cells stayed within the
device budget on every rank (disk: each rank's or the node's record files), expert-parallel and
dynamic cells log the modelled per-rank load every step (dynamic: its placement's fields and
the summary's means), and a dynamic run leaves no store name in /dev/shm.

Each cell trains once per module (the `trained` fixture); the tests after the matrix reuse those
run directories: a dynamic run with offloaded experts resumes on 2 dynamic ranks with the same
residency, a finished dynamic disk-tier run resumes straight into its end-of-run sample (a
forward right after loading), and the single-process checkpoint resumes on 2 dynamic ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from moescale.train.assembly import check_parts
from moescale.shared_store.node_store import shm_directory
from moescale.train.config import load_config
from moescale.train.launch import train_distributed
from train_helpers import (TINY, assert_same_run, checkpoint_tensors, resume_copy, run_records,
                           train_run)

pytestmark = pytest.mark.slow

STEPS = 20
OPTIONS = dict(TINY, **{"train.steps": str(STEPS), "train.eval_interval": "10",
                        "train.checkpoint_interval": "10", "train.keep_last": "2",
                        "optim.grad_clip": "1.0"})
EXCHANGES = {
    "single": {},
    "static-ep": {"parallel.ep_size": "2"},
    "pipelined-2": {"parallel.ep_size": "2", "parallel.chunks": "2"},
    "pipelined-auto": {"parallel.ep_size": "2", "parallel.chunks": "auto",
                       "parallel.reuse": "auto"},
    "dynamic": {"parallel.placement": "dynamic"},
    "sharded-ep": {"parallel.ep_size": "2", "parallel.dense": "shard"},   # FSDP2 dense half
}
RESIDENCIES = {
    "resident": {},
    "host": {"offload.mode": "host"},
    "disk": {"offload.mode": "disk", "offload.host_cache": "192KiB"},
}


def _config(corpus, run_dir, **overrides):
    return load_config(None, dict(OPTIONS, **overrides, **{"data.path": str(corpus),
                                                           "train.run_dir": str(run_dir)}))


def _train(config, run_dir, ranks: int, resume: bool = False) -> None:
    train_run(config, run_dir, ranks, STEPS, resume)


def _store_files() -> set[str]:
    return {n for n in os.listdir(shm_directory()) if n.startswith("moescale-store-")}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Single-process resident training: the numbers every cell must log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _train(_config(corpus, run_dir), run_dir, 1)
    return run_dir, run_records(run_dir)


@pytest.fixture(scope="module")
def trained(corpus, reference, tmp_path_factory):
    """`trained(exchange, residency)`: the run directory of the cell's 20-step run, trained the
    first time a test asks for it (2 ranks, or one process for the single-process row). Tests
    copy it before resuming; none writes into it."""
    runs = {("single", "resident"): reference[0]}

    def run(exchange: str, residency: str):
        if (exchange, residency) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{exchange}-{residency}") / "run"
            config = _config(corpus, run_dir, **EXCHANGES[exchange], **RESIDENCIES[residency])
            before = _store_files()
            _train(config, run_dir, 1 if exchange == "single" else 2)
            assert _store_files() == before     # a store's name goes once every rank mapped it
            runs[exchange, residency] = run_dir
        return runs[exchange, residency]
    return run


def _no_foreach(optimizer: dict) -> dict:
    return dict(optimizer, param_groups=[{k: v for k, v in g.items() if k != "foreach"}
                                         for g in optimizer["param_groups"]])


def _check_outputs(run_dir, ref_dir, exchange: str, residency: str) -> None:
    """The cell's summary, checkpoint and metrics beyond the logged numbers (module doc)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = 1 if exchange == "single" else 2
    assert summary["world_size"] == ranks and summary["placement"] == \
        ("dynamic" if exchange == "dynamic" else "static")
    tensors, state = checkpoint_tensors(run_dir, STEPS)
    one_tensors, one_state = checkpoint_tensors(ref_dir, STEPS)
    assert tensors.keys() == one_tensors.keys() and state["step"] == STEPS
    assert not any("experts." in k for k in tensors)       # the experts are in the shards
    dense = ("model.", "optim.") if residency == "resident" else ("model.",)
    for key, value in one_tensors.items():
        if key.startswith(dense) and value.is_floating_point():
            torch.testing.assert_close(tensors[key], value, rtol=1e-3, atol=1e-5, msg=key)
    if residency == "resident":     # foreach: the kernels (not with sharded + plain tensors)
        assert _no_foreach(state["optimizer"]) == _no_foreach(one_state["optimizer"])
    # every rank wrote a shard of its own experts; together they hold each layer's 4 once
    shards = state["expert_shards"]
    assert sorted(s["rank"] for s in shards) == list(range(ranks))
    shards_dir = run_dir / "checkpoints" / f"expert-shards-{STEPS:08d}"
    assert sorted(p.name for p in shards_dir.iterdir()) == [f"rank{r:05d}" for r in range(ranks)]
    for layer in shards[0]["experts"]:
        held = sorted(tuple(r) for s in shards for r in s["experts"][layer])
        assert held == ([(0, 4)] if ranks == 1 else [(0, 2), (2, 4)]), (layer, held)
    if residency != "resident":
        assert summary["offload_plan"] == residency
        memory = summary["memory"]
        peaks = memory.get("device_peak_bytes_per_rank", [memory["device_peak_bytes"]])
        assert len(peaks) == ranks
        for peak in peaks:                              # every rank streamed experts
            assert 0 < peak <= memory["device_budget_bytes"]
    if residency == "disk":
        assert memory["disk_read_bytes"] > 0
        store = run_dir / "expert-store"
        if exchange == "dynamic":           # one node store: a current file per expert
            assert len(list((store / "node0").rglob("expert*.bin"))) == 2 * 4
            linked = list(shards_dir.rglob("expert*.bin"))   # the records: hard links
            assert linked and all(p.stat().st_nlink >= 2 for p in linked)
        elif ranks == 2:                    # each rank its own directory of its experts
            for rank in range(2):
                assert len(list((store / f"rank{rank}").rglob("expert*.bin"))) == 2 * 2
    train = [r for r in run_records(run_dir) if r["kind"] == "train"]
    assert len(train) == STEPS
    if exchange == "single":                # one device: no per-device load
        assert "device_load_max_over_mean" not in train[0]
    for r in train:
        if exchange != "single":            # the modelled max/mean per-rank load
            assert r["device_load_max_over_mean"] >= 1.0
        if exchange.startswith("pipelined"):    # each layer's chunks and strategy
            assert len(r["pipeline"]) == 2, r["pipeline"]
            for chunks, strategy in r["pipeline"].values():
                assert chunks >= 1 and strategy in ("none", "S2", "S4", "unpipelined")
        if exchange == "dynamic":
            assert r["device_load_max"] >= r["device_load_mean"] > 0
            assert r["static_load_max_over_mean"] >= 1.0
            assert r["device_load_worst_layer"] >= r["device_load_max_over_mean"] - 1e-12
            # rows: every routed token-expert pair of the step's 2 MoE layers, over 2 devices
            assert r["device_load_mean"] == sum(map(sum, r["tokens_per_expert"])) / 2
    if exchange == "dynamic":
        mean = sum(r["device_load_max_over_mean"] for r in train) / STEPS
        assert summary["mean_device_load_max_over_mean"] == pytest.approx(mean)
        assert "mean_static_load_max_over_mean" in summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("residency", RESIDENCIES)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_every_setup_trains_the_single_process_run_and_resumes(corpus, reference, trained,
                                                               tmp_path, exchange, residency):
    ref_dir, want = reference
    overrides = dict(EXCHANGES[exchange], **RESIDENCIES[residency])
    config = _config(corpus, tmp_path / "run", **overrides)
    try:
        check_parts(config)
    except ValueError as err:        # a part that cannot serve the cell refuses it clearly
        assert exchange == "dynamic" and residency != "resident", err
        assert "\n" not in str(err) and "offload.mode device-only" in str(err)
        return
    run_dir = trained(exchange, residency)
    assert_same_run(run_records(run_dir), want)
    if exchange == "static-ep" and residency != "resident":   # the host AdamW's clipping norm
        for a, b in zip(run_records(run_dir), want):
            if "grad_norm" in b:
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
    _check_outputs(run_dir, ref_dir, exchange, residency)
    # resume the step-10 checkpoint at the other rank count, keeping the residency
    again = resume_copy(run_dir, tmp_path / "again", STEPS // 2)
    other = {"parallel.ep_size": "2"} if exchange == "single" else {}
    resumed = _config(corpus, again, **RESIDENCIES[residency], **other)
    _train(resumed, again, 2 if exchange == "single" else 1, resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("residency", ["host", "disk"])
def test_dynamic_offloaded_checkpoint_resumes_on_two_dynamic_ranks(corpus, reference, trained,
                                                                   tmp_path, residency):
    """Each rank reads its block of the node's store back from its own shard."""
    again = resume_copy(trained("dynamic", residency), tmp_path / "again", STEPS // 2)
    _train(_config(corpus, again, **EXCHANGES["dynamic"], **RESIDENCIES[residency]), again, 2,
           resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, reference[1], first_step=STEPS // 2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("residency", ["resident", "disk"])
def test_single_process_checkpoint_resumes_on_two_dynamic_ranks(corpus, reference, tmp_path,
                                                                residency):
    """Local rank 0 writes the restored experts and moments into the node's store."""
    ref_dir, want = reference
    again = resume_copy(ref_dir, tmp_path / "again", STEPS // 2)
    _train(_config(corpus, again, **EXCHANGES["dynamic"], **RESIDENCIES[residency]), again, 2,
           resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.timeout(200)
def test_a_finished_dynamic_disk_run_resumes_straight_into_sampling(corpus, trained, tmp_path):
    """Loading moves each rank's block of records to new files; a forward before any
    training step (the end-of-run sample) must still read the current files."""
    again = resume_copy(trained("dynamic", "disk"), tmp_path / "again", STEPS)
    config = _config(corpus, again, **EXCHANGES["dynamic"], **RESIDENCIES["disk"],
                     **{"train.sample_tokens": "8"})
    code, summary = train_distributed(config, again, 2, resume=True, quiet=True, deadline_s=150)
    assert code == 0 and summary["step"] == STEPS and summary["sample"]
