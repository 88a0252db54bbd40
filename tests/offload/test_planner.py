"""The offloading planner: memory per tier, the largest expert count each mode holds in ES-MoE's
setting (ordered device < pin <= host < disk), the pick, and the `moescale plan` command."""

import pytest

from moescale.offload.plan_cli import main
from moescale.offload.planner import (A100_NODE, MODES, Budgets, ModelSpec, estimate,
                                      largest_experts, plan)

GB = 1 << 30
ESMOE = dict(moe_layers=24, d_model=1536, d_ff=6144, top_k=2, tokens=8192)
BUDGETS = Budgets(device_bytes=40 * GB, host_bytes=512 * GB, disk_bytes=4096 * GB)


def test_memory_per_tier_is_what_the_modes_promise():
    spec = ModelSpec(num_experts=16, **ESMOE)
    by_mode = {e.mode: e for e in (estimate(spec, BUDGETS, A100_NODE, m) for m in MODES)}
    state = 24 * 16 * spec.expert_params * 16
    assert by_mode["device"].host_bytes == 0 and by_mode["device"].device_bytes > state
    assert by_mode["host"].host_bytes == state and by_mode["host"].disk_bytes == 0
    assert by_mode["disk"].disk_bytes == state and by_mode["disk"].host_bytes == min(256 * GB, state)
    assert by_mode["pin"].device_bytes > by_mode["host"].device_bytes


def test_largest_expert_counts_in_the_esmoe_setting():
    spec = ModelSpec(num_experts=8, **ESMOE)
    most = {m: largest_experts(spec, BUDGETS, A100_NODE, m) for m in MODES}
    assert 1 <= most["device"] < 8 < most["pin"] <= most["host"] < most["disk"]
    for mode, num in most.items():  # exact: num fits, num + 1 does not
        fits = [estimate(ModelSpec(num_experts=n, **ESMOE), BUDGETS, A100_NODE, mode).fits
                for n in (num, num + 1)]
        assert fits == [True, False], mode


def test_pick_prefers_the_device_when_it_fits_and_none_when_nothing_fits():
    small = ModelSpec(moe_layers=2, d_model=256, d_ff=1024, num_experts=8, tokens=2048)
    assert plan(small, BUDGETS, A100_NODE)[1] == "device"
    tiny_budget = Budgets(device_bytes=1, host_bytes=1, disk_bytes=1)
    assert plan(small, tiny_budget, A100_NODE)[1] is None


def test_bad_spec_names_the_argument():
    with pytest.raises(ValueError, match="d_ff"):
        ModelSpec(moe_layers=1, d_model=8, d_ff=0, num_experts=2)
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(moe_layers=1, d_model=8, d_ff=8, num_experts=2, dtype="int4")


def test_plan_command_prints_every_mode_and_a_pick(capsys):
    assert main(["--experts", "32", "--max-experts"]) == 0
    out = capsys.readouterr().out
    for mode in MODES:
        assert mode in out
    assert "pick:" in out and "largest expert count" in out


def _gpt_like():
    import torch
    from moescale import MoE
    torch.manual_seed(0)
    return torch.nn.Sequential(MoE(32, 8, 2, d_ff=64), MoE(32, 8, 2, d_ff=64))


@pytest.mark.parametrize("device_bytes,host_bytes,want,tier,pin", [
    (1 << 30, 1 << 30, "device", "host", 1.0),         # everything fits on the device
    (240_000, 1 << 30, "pin", "host", 0.25),            # the device holds slots + hot experts
    (240_000, 1 << 19, "disk", "disk", 0.0),            # the host cannot hold the state
])
def test_auto_tier_follows_the_planner(tmp_path, device_bytes, host_bytes, want, tier, pin):
    from moescale.offload import OffloadConfig, offload_moe
    model = _gpt_like()
    engine = offload_moe(model, OffloadConfig(
        tier="auto", tokens_per_micro_batch=64, device_budget_bytes=device_bytes,
        host_budget_bytes=host_bytes, host_cache_bytes=1 << 19, directory=str(tmp_path),
        rates="a100", device="cpu"))
    assert engine.plan[1] == want
    assert engine.config.tier == tier and engine.config.pin_fraction == pin
    import torch
    model(torch.randn(16, 32)).sum().backward()
    engine.step()
    engine.close()


def test_auto_tier_needs_its_inputs():
    from moescale.offload import OffloadConfig
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        OffloadConfig(tier="auto", device_budget_bytes=1 << 20)


def test_moescale_plan_through_the_top_level_cli(capsys):
    from moescale.cli import main as cli_main
    assert cli_main(["plan", "--experts", "8", "--moe-layers", "2"]) == 0
    assert "pick:" in capsys.readouterr().out
    assert cli_main(["plan", "--experts", "0"]) == 2  # a user error: one line, exit 2
    assert "num_experts=0" in capsys.readouterr().err
