"""Every exchange with every residency trains the single-process resident run, and resumes.

One parametrized set-up matrix: exchange {single process, static expert parallelism,
pipelined expert parallelism with 2 chunks and with chunks=auto (reuse auto), dynamic
placement} x residency {resident, host tier, disk tier}. Each cell trains 20 AdamW steps (2
gloo ranks, real processes; the single-process row on one) and must log the losses,
validation losses and routed token counts of single-process resident training (losses within
1e-5 relative); then its step-10 checkpoint is resumed at the other rank count (2-rank cells
on one process with the same residency, the single-process row on 2 expert-parallel ranks) and
must log the same losses again. A cell whose parts refuse the combination must say so with
one clear line (the test then checks that refusal instead).
"""

from __future__ import annotations

import os

import pytest

from moescale.train.assembly import check_parts
from moescale.train.config import load_config
from moescale.train.launch import train_distributed
from moescale.train.trainer import Trainer
from train_helpers import TINY, assert_same_run, resume_copy, run_records

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
    if ranks > 1:
        code, summary = train_distributed(config, run_dir, ranks, resume=resume, quiet=True,
                                          deadline_s=150)
        assert code == 0 and summary["world_size"] == ranks and summary["step"] == STEPS
    else:
        trainer = Trainer(config, run_dir, resume=resume, out=open(os.devnull, "w"),
                          err=open(os.devnull, "w"))
        assert trainer.run() == 0


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Single-process resident training: the numbers every cell must log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _train(_config(corpus, run_dir), run_dir, 1)
    return run_dir, run_records(run_dir)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("residency", RESIDENCIES)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_every_setup_trains_the_single_process_run_and_resumes(corpus, reference, tmp_path,
                                                               exchange, residency):
    ref_dir, want = reference
    overrides = dict(EXCHANGES[exchange], **RESIDENCIES[residency])
    config = _config(corpus, tmp_path / "run", **overrides)
    try:
        check_parts(config)
    except ValueError as err:        # a part that cannot serve the cell refuses it clearly
        assert exchange == "dynamic" and residency != "resident", err
        assert "\n" not in str(err) and "offload.mode device-only" in str(err)
        return
    if exchange == "single" and residency == "resident":
        run_dir = ref_dir
    else:
        run_dir = tmp_path / "run"
        _train(config, run_dir, 1 if exchange == "single" else 2)
        assert_same_run(run_records(run_dir), want, grad_norm=False)
    if exchange.startswith("pipelined"):    # every step logs each layer's chunks and strategy
        for r in run_records(run_dir):
            if r["kind"] == "train":
                assert len(r["pipeline"]) == 2, r["pipeline"]
                for chunks, strategy in r["pipeline"].values():
                    assert chunks >= 1 and strategy in ("none", "S2", "S4", "unpipelined")
    # resume the step-10 checkpoint at the other rank count, keeping the residency
    again = resume_copy(run_dir, tmp_path / "again", STEPS // 2)
    other = {"parallel.ep_size": "2"} if exchange == "single" else {}
    resumed = _config(corpus, again, **RESIDENCIES[residency], **other)
    _train(resumed, again, 2 if exchange == "single" else 1, resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2, grad_norm=False)
