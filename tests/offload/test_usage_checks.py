"""The offloading loop's two silent mistakes raise ValueError naming the fix
(moescale/offload/usage_checks.py): an optimizer built before offload_moe (caught by
engine.follow and at the optimizer's first step), and a new step's forward without
engine.step(). The correct loops, with and without gradient accumulation, still train."""

from __future__ import annotations

import pytest
import torch
from equivalence_models import batches, make_model

from moescale.offload import OffloadConfig, offload_moe


def _engine(model, mode="eager", lr=1e-3):
    """The offloaded model's engine and an optimizer built the right way (after it)."""
    engine = offload_moe(model, OffloadConfig(tier="host", device="cpu",
                                              device_budget_experts=3, step_mode=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    engine.follow(opt)
    return engine, opt


def test_optimizer_built_before_offload_moe_is_refused_by_follow():
    model = make_model()
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _ = _engine(model)
    try:
        with pytest.raises(ValueError, match="build the optimizer after offload_moe"):
            engine.follow(early)
    finally:
        engine.close()


def test_optimizer_built_before_offload_moe_is_refused_at_its_first_step():
    model = make_model()
    early = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, _ = _engine(model)
    try:
        idx, tgt = next(batches(0, 1))
        model(idx, tgt)[1].backward()
        engine.step()
        with pytest.raises(ValueError, match=r"model\.parameters\(\)"):
            early.step()
    finally:
        engine.close()
    early.step()   # the engine is closed: its check is gone with it


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_a_forward_after_a_backward_without_engine_step_is_refused(mode):
    model = make_model()
    engine, opt = _engine(model, mode)
    try:
        (idx, tgt), = batches(0, 1)
        model(idx, tgt)[1].backward()
        opt.step(); opt.zero_grad()
        with torch.no_grad():
            model(idx, tgt)       # evaluation before the step: allowed (no backward follows)
        with pytest.raises(ValueError, match=r"engine\.step\(\) was not called"):
            model(idx, tgt)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_the_correct_loops_train(mode):
    model = make_model()
    engine, opt = _engine(model, mode, lr=1e-2)
    losses = []
    try:
        for step in range(3):
            for i, (idx, tgt) in enumerate(batches(step, 2)):
                engine.begin_micro_batch(last=i == 1)
                loss = model(idx, tgt)[1]
                (loss / 2).backward()
            engine.step(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        model(idx, tgt)[1].backward()   # a backward that does not count, discarded:
        engine.zero_grad()              # then no step is missing
        model(idx, tgt)
    finally:
        engine.close()
    assert all(torch.isfinite(torch.tensor(losses)))
