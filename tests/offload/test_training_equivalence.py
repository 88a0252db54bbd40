"""The key equivalence: a small MoE GPT trained 20 steps with offloaded experts (host or disk
tier, a device budget of 2 experts) gives the losses of all-resident training with
torch.optim.AdamW (fp32, relative difference <= 1e-5 at every step), for eager and deferred
steps, gradient accumulation 1 and 4, and the keep / recompute / offload activation policies.
Also: global-norm clipping (deferred), the LR schedule shared through follow(), and the device
budget never exceeded."""

import functools

import pytest

from equivalence_models import make_model, train
from moescale.offload import OffloadConfig

STEPS = 20


@functools.cache
def reference_losses(accum: int, clip: float | None = None, glu: bool = False):
    return tuple(train(make_model(glu=glu), STEPS, accum, clip=clip)[0])


def assert_same_losses(got, want):
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: offloaded {a} vs resident {b}"


def check(config: OffloadConfig, accum: int, clip=None, glu=False):
    losses, _, engine = train(make_model(glu=glu), STEPS, accum, config, clip=clip)
    assert_same_losses(losses, reference_losses(accum, clip, glu))
    assert engine.device.peak_bytes <= engine.device.budget_bytes
    assert engine.device.used_bytes == 0
    return engine


def settings(fast: set[tuple[str, int, str]]) -> list:
    """Every (mode, accum, policy); those not in `fast` are marked slow (the fast lane keeps a
    few that together take every value of each axis, the full suite runs them all)."""
    return [pytest.param(m, a, p, id=f"{m}-{a}-{p}",
                         marks=() if (m, a, p) in fast else pytest.mark.slow)
            for m in ("eager", "deferred") for a in (1, 4)
            for p in ("keep", "recompute", "offload")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,accum,policy", settings({("eager", 1, "keep"),
                                                        ("deferred", 4, "recompute")}))
def test_host_tier_matches_resident(mode, accum, policy):
    check(OffloadConfig(tier="host", device_budget_experts=2, step_mode=mode,
                        activation_policy=policy), accum)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,accum,policy", settings({("deferred", 1, "offload"),
                                                        ("eager", 1, "recompute")}))
def test_disk_tier_matches_resident(tmp_path, mode, accum, policy):
    record = 4 * 4 * (16 * 32 * 2)  # one expert's fp32 master + grad + two moments
    engine = check(OffloadConfig(tier="disk", directory=str(tmp_path), host_cache_bytes=3 * record,
                                 device_budget_experts=2, step_mode=mode,
                                 activation_policy=policy), accum)
    assert engine.store.peak_cache_bytes <= 3 * record
    assert engine.store.bytes_written > 0 and engine.store.bytes_read > 0
    assert len(list(tmp_path.rglob("expert*.bin"))) == 8


@pytest.mark.timeout(120)
def test_deferred_global_norm_clipping_matches_resident():
    check(OffloadConfig(device_budget_experts=2, step_mode="deferred"), 2, clip=0.05)


@pytest.mark.timeout(120)
def test_glu_experts_with_lookahead_and_pinning():
    check(OffloadConfig(device_budget_experts=5, lookahead=2, pin_fraction=0.25,
                        step_mode="eager"), 1, glu=True)


def test_clipping_needs_deferred_mode():
    with pytest.raises(ValueError, match="deferred"):
        train(make_model(), 1, 1, OffloadConfig(step_mode="eager"), clip=1.0)
