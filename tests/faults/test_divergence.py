"""Divergence never saves poison (issue 13, item 1).

The reported run: `moescale train --optim.lr 1e6 --optim.warmup_steps 0
--train.checkpoint_interval 1 --train.keep_last 1`: step 2's update blows the weights up, step
3's loss is finite but its gradient norm NaN. Before the fix AdamW stepped with it, a NaN
checkpoint (valid checksum) replaced the last good one and the run was lost. Now each such step
is skipped (one line each), `train.max_skips` in a row stop the run with one line and exit 3,
and every checkpoint on disk verifies and is finite; loading refuses a NaN checkpoint (one
written before the fix) and falls back to the previous one; the host optimizer of offloaded
experts refuses to step an expert whose gradient is not finite (eager mode steps experts
during backward, before any global norm exists), and a dynamic-placement run (2 ranks, shared
store) skips and stops on every rank alike.
"""

from __future__ import annotations

import json

import pytest
import torch
from fault_helpers import losses, rank_env, tiny_args
from safetensors.torch import save_file

from moescale.cli import main
from moescale.layers.moe import MoE
from moescale.offload import OffloadConfig, offload_moe
from moescale.parallel.launch import free_port
from moescale.train.checkpoint import (NonFiniteError, _digest, checkpoint_path,
                                       list_checkpoints, load_checkpoint, load_latest,
                                       save_checkpoint)

DIVERGE = {"optim__lr": "1e6", "optim__warmup_steps": "0", "train__checkpoint_interval": "1",
           "train__keep_last": "1", "train__steps": "12"}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.timeout(120)
def test_lr_1e6_skips_steps_then_stops_in_one_line_with_finite_checkpoints(corpus, tmp_path,
                                                                         capsys):
    run_dir = tmp_path / "run"
    code = main(["train", *tiny_args(corpus, run_dir, **DIVERGE)])
    err = capsys.readouterr().err
    assert code == 3, err
    lines = _lines(err)
    skips = [line for line in lines if "skipped the optimizer step" in line]
    assert len(skips) == 5 and lines[-1].startswith("moescale train: training diverged: 5 "
                                                    "steps in a row")
    assert "Traceback" not in err and str(run_dir) in lines[-1]
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert sum("skipped" in r for r in records) == 5
    found = list_checkpoints(run_dir / "checkpoints")
    assert found
    for _, path in found:
        tensors, _ = load_checkpoint(path)        # verifies, and refuses NaN / Inf
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    # issue 31: step 1's update ruined the weights while they stayed finite (from step 2 the
    # loss is ln 256, the gradient 0); the checkpoints written within trust.TRUST_STEPS of the
    # divergence are set aside, the initial state is kept whatever keep_last says, the stop
    # message names it, and a resume with a sane learning rate trains from it to the end
    assert "continue from the checkpoint of step 0 (ckpt_00000000.safetensors)" in lines[-1]
    assert [s for s, _ in found] == [0]
    assert list((run_dir / "checkpoints").glob("ckpt_*.safetensors.diverged"))
    code = main(["train", "--resume", str(run_dir), "--optim.lr", "3e-3",
                 "--train.steps", "20"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "resumed from" in err and "ckpt_00000000" in err
    assert [r[0] for r in losses(run_dir)] == list(range(1, 21))
    assert all(r[2] is not None and r[2] > 0 for r in losses(run_dir))   # it learns again


def test_save_refuses_and_load_falls_back_from_non_finite_tensors(tmp_path):
    good = {"model.w": torch.ones(3), "rng.torch": torch.zeros(4, dtype=torch.uint8)}
    state = {"step": 1}
    save_checkpoint(tmp_path, 1, good, state, keep_last=3)
    bad = {"model.w": torch.tensor([1.0, float("nan"), float("inf")]),
           "rng.torch": torch.zeros(4, dtype=torch.uint8)}
    with pytest.raises(NonFiniteError, match="model.w holds 2 non-finite"):
        save_checkpoint(tmp_path, 2, bad, {"step": 2}, keep_last=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    # a NaN checkpoint with a valid checksum, as written before the step guard existed
    state_json = json.dumps({"step": 2}, sort_keys=True)
    save_file(bad, str(checkpoint_path(tmp_path, 2)),
              metadata={"state": state_json, "sha256": _digest(state_json, bad),
                        "format": "moescale/1"})
    warnings = []
    path, tensors, got = load_latest(tmp_path, warn=warnings.append)
    assert path == checkpoint_path(tmp_path, 1) and got == state
    assert len(warnings) == 1 and "non-finite values (model.w: 2 NaN or Inf" in warnings[0]


def test_host_optimizer_never_steps_an_expert_with_a_non_finite_gradient():
    torch.manual_seed(0)
    moe = MoE(12, 4, 2, d_ff=24)
    engine = offload_moe(moe, OffloadConfig(device_budget_experts=2, step_mode="eager"))
    try:
        layout = engine.store.layouts[0]
        before = {e: engine.expert_state(0, e) for e in range(4)}
        shapes = list(layout.split(torch.zeros(layout.numel)).values())
        poison = [torch.full_like(t, float("nan")) for t in shapes]
        poison[0].view(-1)[0] = 1.0
        huge = [torch.full_like(t, 3e19) for t in shapes]        # finite, square overflows
        engine.optimizer.accumulate((0, 1), poison, last=True)
        engine.optimizer.accumulate((0, 2), huge, last=True)
        engine.optimizer.accumulate((0, 3), [torch.ones_like(t) for t in shapes], last=True)
        engine.synchronize()
        assert engine.optimizer.skipped_steps == 2
        for e in (1, 2):
            after = engine.expert_state(0, e)
            assert all(torch.equal(after[k], before[e][k]) for k in after)
        assert not torch.equal(engine.expert_state(0, 3)["w1_EDF"], before[3]["w1_EDF"])
        assert engine.optimizer.grad_norm_sq() == 0        # refused gradients are dropped
    finally:
        engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step_mode", ["eager", "deferred"])
def test_offloaded_run_with_lr_1e6_keeps_the_store_finite(corpus, tmp_path, capsys, step_mode):
    from moescale.train.config import load_config
    from moescale.train.trainer import Trainer

    run_dir = tmp_path / "run"
    extra = {"offload__mode": "host", "offload__step_mode": step_mode,
             "train__max_skips": "3", **DIVERGE}
    if step_mode == "eager":
        extra["optim__grad_clip"] = "0"
    code = main(["train", *tiny_args(corpus, run_dir, **extra)])
    err = capsys.readouterr().err
    assert code in (0, 3) and "Traceback" not in err, err
    assert code == 0 or _lines(err)[-1].startswith("moescale train: training diverged")
    assert any("skipped" in r for r in map(json.loads, (run_dir / "metrics.jsonl")
                                           .read_text().splitlines()))
    config = load_config(run_dir / "config.toml")
    trainer = Trainer(config, run_dir, resume=True)     # the newest checkpoint, both halves
    try:
        store = trainer.parts.residency.engine.store
        for key in store.keys():
            record, _ = store.read_record(key)
            assert torch.isfinite(record).all(), key
    finally:
        trainer.parts.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dynamic_placement_skips_and_stops_on_every_rank(launcher, corpus, tmp_path):
    port = free_port()
    args = ["train", *tiny_args(corpus, tmp_path / "run", parallel__placement="dynamic",
                                train__max_skips="3", **DIVERGE)]
    ranks = [launcher.start(args, tmp_path, log=tmp_path / f"rank{r}.log",
                            env=rank_env(r, 2, port)) for r in range(2)]
    codes = [r.wait(100) for r in ranks]
    assert codes == [3, 3], [r.text() for r in ranks]
    assert _lines(ranks[0].text())[-1].startswith("moescale train: training diverged: 3 steps")
    assert sum(1 for r in losses(tmp_path / "run") if r[2] != r[2]) >= 3    # NaN norms logged
    for _, path in list_checkpoints(tmp_path / "run" / "checkpoints"):
        load_checkpoint(path)


def test_checkpoint_trust_keeps_the_last_checkpoint_from_before_a_loss_spike():
    """trust.py: a checkpoint is trusted after 10 clean steps; a loss spike (1.5x the recent
    median) or a skipped step makes the checkpoints within 10 steps before it untrusted, and
    the newest trusted one is kept and is where a diverged run continues from."""
    from moescale.train.trust import CheckpointTrust

    trust = CheckpointTrust()
    for step in range(1, 31):
        trust.note(step, 2.0 - step * 0.01, None)
    assert trust.protected([10, 20, 29, 30], 30) == {20, 29}      # anchor 20, candidate 29
    assert trust.protected([10, 20, 29, 30], 30, final=True) == set()
    trust.note(31, 9.0, None)                                     # a spike, finite
    for step in range(32, 37):
        trust.note(step, 2.0, "gradient norm nan")
    assert trust.anomalies == list(range(31, 37))
    steps = [20, 25, 30, 36]
    assert trust.resume_point(steps, 36) == 20          # 25 and 30 lie within 10 of the spike
    assert trust.protected(steps, 36) == {20, 25}
    assert trust.protected(steps, 36, final=True) == {20, 25}     # an anomaly at the end
