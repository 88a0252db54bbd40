"""`moescale train --parallel.placement dynamic --offload.mode host|disk` on 2 gloo ranks.

The node's experts live in one store shared by both ranks (host tier: /dev/shm; disk tier:
record files under the run's expert-store/node0/); every MoE call places them by LPT (+ hot
expert splitting) and each rank streams the experts placed on it through its own device budget
(3 experts). Checked against single-process resident training of the same config (torch's
AdamW, global-norm clipping 1.0): 12 steps give the same losses, validation losses, aux losses,
grad norms and routed counts (fp32 tolerance: 1e-5 relative, grad norm 1e-4); the device peak
of every rank stays within its budget; the step-6 checkpoint (expert shards: each rank its
block of the node's store; disk-tier records hard-linked) resumes on 2 dynamic ranks with the
same residency and on one process with that residency (the offload engine), giving the
uninterrupted numbers; a single-process resident checkpoint resumes on 2 dynamic disk-tier
ranks; a finished disk-tier run resumes straight into the end-of-run sample (a forward right
after loading); two micro-batches per step match too; unsupported offload options are refused.
"""

from __future__ import annotations

import os

import pytest

from moescale.train.config import load_config
from moescale.train.launch import train_distributed
from moescale.train.residency import check_residency
from moescale.train.trainer import Trainer
from train_helpers import TINY, assert_same_run, resume_copy, run_records

pytestmark = pytest.mark.distributed

STEPS = 12
OPTIONS = dict(TINY, **{"train.steps": str(STEPS), "train.eval_interval": "6",
                        "train.checkpoint_interval": "6", "train.keep_last": "2",
                        "optim.grad_clip": "1.0", "train.device": "cpu"})
DYNAMIC = {"parallel.placement": "dynamic"}
MODES = {"host": {"offload.mode": "host"},
         "disk": {"offload.mode": "disk", "offload.host_cache": "192KiB"}}


def _config(corpus, run_dir, base=OPTIONS, **overrides):
    return load_config(None, dict(base, **overrides, **{"data.path": str(corpus),
                                                        "train.run_dir": str(run_dir)}))


def _train(config, run_dir, ranks: int, resume: bool = False, steps: int = STEPS) -> dict:
    if ranks > 1:
        code, summary = train_distributed(config, run_dir, ranks, resume=resume, quiet=True,
                                          deadline_s=150)
        assert code == 0 and summary["world_size"] == ranks and summary["step"] == steps
        return summary
    trainer = Trainer(config, run_dir, resume=resume, out=open(os.devnull, "w"),
                      err=open(os.devnull, "w"))
    assert trainer.run() == 0
    return {}


def _store_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("moescale-store-")}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Single-process resident training: the numbers every run must log."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _train(_config(corpus, run_dir), run_dir, 1)
    return run_dir, run_records(run_dir)


@pytest.fixture(scope="module")
def dynamic_runs(corpus, tmp_path_factory):
    """mode -> (run dir, summary) of the 2-rank dynamic run with offloaded experts."""
    out = {}
    for mode, options in MODES.items():
        run_dir = tmp_path_factory.mktemp(f"dyn-{mode}") / "run"
        before = _store_files()
        summary = _train(_config(corpus, run_dir, **DYNAMIC, **options), run_dir, 2)
        assert _store_files() == before
        out[mode] = run_dir, summary
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", MODES)
def test_two_rank_dynamic_offloaded_run_equals_single_process(reference, dynamic_runs, mode):
    _, want = reference
    run_dir, summary = dynamic_runs[mode]
    assert_same_run(run_records(run_dir), want)
    assert summary["placement"] == "dynamic" and summary["offload_plan"] == mode
    memory = summary["memory"]
    assert len(memory["device_peak_bytes_per_rank"]) == 2
    assert 0 < memory["device_peak_bytes"] <= memory["device_budget_bytes"]
    shards = run_dir / "checkpoints" / f"expert-shards-{STEPS:08d}"
    assert sorted(p.name for p in shards.iterdir()) == ["rank00000", "rank00001"]
    if mode == "disk":
        assert memory["disk_read_bytes"] > 0 and memory["disk_written_bytes"] > 0
        files = list((run_dir / "expert-store" / "node0").rglob("expert*.bin"))
        assert len(files) == 2 * 4      # one current file per expert, every one stepped
        linked = list(shards.rglob("expert*.bin"))      # the checkpoint's records: hard links
        assert linked and all(p.stat().st_nlink >= 2 for p in linked)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_resumes_on_two_dynamic_ranks_and_on_one_process(corpus, reference,
                                                                    dynamic_runs, tmp_path,
                                                                    mode):
    _, want = reference
    run_dir, _ = dynamic_runs[mode]
    again = resume_copy(run_dir, tmp_path / "dyn", STEPS // 2)
    _train(_config(corpus, again, **DYNAMIC, **MODES[mode]), again, 2, resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)
    one = resume_copy(run_dir, tmp_path / "one", STEPS // 2)
    _train(_config(corpus, one, **MODES[mode]), one, 1, resume=True)
    got = [r for r in run_records(one) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.timeout(200)
def test_single_process_checkpoint_resumes_on_dynamic_disk_ranks(corpus, reference, tmp_path):
    ref_dir, want = reference
    again = resume_copy(ref_dir, tmp_path / "dyn", STEPS // 2)
    _train(_config(corpus, again, **DYNAMIC, **MODES["disk"]), again, 2, resume=True)
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.timeout(200)
def test_gradient_accumulation_on_the_disk_tier(corpus, tmp_path):
    """Two micro-batches per step: the gradient of an expert may be accumulated by different
    owners in the two passes, through the files (a fence between the passes)."""
    base = dict(OPTIONS, **{"train.steps": "6", "train.eval_interval": "0",
                            "train.checkpoint_interval": "0", "train.grad_accum": "2"})
    single = tmp_path / "single"
    _train(_config(corpus, single, base=base), single, 1)
    dynamic = tmp_path / "dyn"
    _train(_config(corpus, dynamic, base=base, **DYNAMIC, **MODES["disk"]), dynamic, 2,
           steps=6)
    assert_same_run(run_records(dynamic), run_records(single))


@pytest.mark.parametrize("option, value, message", [
    ("offload.mode", "pin", "use offload.tier host or disk, or offload.tier device-only"),
    ("offload.activation_policy", "offload", "use offload.activation_policy keep or recompute"),
    ("offload.step_mode", "eager", "use offload.step_mode deferred"),
])
def test_unsupported_offload_options_are_refused(option, value, message):
    overrides = dict(DYNAMIC, **dict(MODES["host"], **{option: value}))
    if option == "offload.step_mode":
        overrides["optim.grad_clip"] = "0"
    with pytest.raises(ValueError, match=message):
        check_residency(load_config(None, overrides))


@pytest.mark.timeout(200)
def test_a_finished_disk_run_resumes_straight_into_sampling(corpus, dynamic_runs, tmp_path):
    """Loading moves each rank's block of records to new files; a forward before any
    training step (the end-of-run sample) must still read the current files."""
    run_dir, _ = dynamic_runs["disk"]
    again = resume_copy(run_dir, tmp_path / "again", STEPS)
    summary = _train(_config(corpus, again, **DYNAMIC, **MODES["disk"],
                             **{"train.sample_tokens": "8"}), again, 2, resume=True)
    assert summary["sample"]
