"""The offloading planner: memory per tier, the largest expert count each mode holds in ES-MoE's
setting (ordered device < pin <= host < disk), the pick, and the `moescale plan` command."""

import pytest

from moescale.offload.plan_cli import main
from moescale.offload.planner import (A100_NODE, MODES, Budgets, ModelSpec, disk_traffic,
                                      estimate, largest_experts, plan)

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


@pytest.mark.parametrize("device_bytes,host_bytes,step_mode,want,tier,pin", [
    (1 << 30, 1 << 30, "eager", "device", "host", 1.0),    # everything fits on the device
    (240_000, 1 << 30, "deferred", "pin", "host", 0.25),   # slots + hot experts: fewer uploads
    (240_000, 1 << 30, "eager", "host", "host", 0.0),      # as fast as pin (AdamW-bound), less
                                                           # device memory
    (240_000, 1 << 19, "eager", "disk", "disk", 0.0),      # the host cannot hold the state
])
def test_auto_tier_follows_the_planner(tmp_path, device_bytes, host_bytes, step_mode, want,
                                       tier, pin):
    from moescale.offload import OffloadConfig, offload_moe
    model = _gpt_like()
    engine = offload_moe(model, OffloadConfig(
        tier="auto", tokens_per_micro_batch=64, device_budget_bytes=device_bytes,
        host_budget_bytes=host_bytes, host_cache_bytes=1 << 19, directory=str(tmp_path),
        rates="a100", device="cpu", step_mode=step_mode))
    assert engine.plan[1] == want
    assert engine.config.tier == tier and engine.config.pin_fraction == pin
    import torch
    model(torch.randn(16, 32)).sum().backward()
    engine.step()
    engine.close()


def test_auto_tier_needs_its_inputs():
    from moescale import MoE
    from moescale.offload import OffloadConfig, offload_moe
    model = MoE(8, 4, 2, d_ff=16)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):   # before anything moves
        offload_moe(model, OffloadConfig(tier="auto", device_budget_bytes=1 << 20))
    assert sum(p.numel() for p in model.experts.parameters()) > 0


def test_moescale_plan_through_the_top_level_cli(capsys):
    from moescale.cli import main as cli_main
    assert cli_main(["plan", "--experts", "8", "--moe-layers", "2"]) == 0
    assert "pick:" in capsys.readouterr().out
    assert cli_main(["plan", "--experts", "0"]) == 2  # a user error: one line, exit 2
    assert "num_experts=0" in capsys.readouterr().err


def _store_traffic(spec: ModelSpec, directory, cache: int, steps: int, **offload_kw):
    """(bytes read, bytes written) of each of `steps` training steps of a real disk-tier
    store holding `spec`'s experts (top-2, a 3-expert device budget), write-back flushed."""
    import torch
    from moescale.bench.offload import MoEStack, training_step
    from moescale.offload import OffloadConfig, offload_moe
    torch.manual_seed(0)
    model = MoEStack(spec.moe_layers, spec.d_model, spec.d_ff, spec.num_experts, 2)
    engine = offload_moe(model, OffloadConfig(tier="disk", directory=str(directory),
                                              host_cache_bytes=cache, device="cpu",
                                              device_budget_experts=3, **offload_kw))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine.follow(opt)
    store, moved = engine.store, []
    for _ in range(steps):
        before = store.bytes_read, store.bytes_written
        training_step(model, torch.randn(spec.tokens, spec.d_model), opt, engine)
        store.flush()
        moved.append((store.bytes_read - before[0], store.bytes_written - before[1]))
    engine.close()
    return moved


@pytest.mark.parametrize("slots,saved", [(4, 0), (8, 16), (16, None)])
def test_disk_traffic_counts_the_bytes_the_store_moves(tmp_path, slots, saved):
    """Steady-state steps of a real disk-tier store (2 layers x 8 experts, rows padded to
    4096 bytes, a cache of N/4, N/2 and all N = 16 records) read and write what
    planner.disk_traffic says: forward master rows, then master + moments read and written.
    Usually exactly, but thread timing moves single steps both ways: under CPU load the
    store's read-ahead sometimes loses its slot to a foreground access and reads a record again
    (up to +30% seen at a cache of N/4 with a load of 9 on 2 cores), and once in a whole-suite
    run a step at a cache of N/4 read 2 rows fewer (a record still cached from the step
    before; and +42% once in a clean-clone CI run, at N/4). So the check is that the scheme's
    bytes, which the planner counts, are what some steady-state step moved exactly, that the
    steady steps' mean read is within 15% of them, and that no single step is more than 60%
    off (writes: 40%)."""
    from moescale.offload.direct_io import align_up
    from moescale.offload.planner import cache_saved_rows, disk_traffic
    layers, d_model, d_ff, experts, tokens = 2, 48, 200, 8, 128
    row = align_up(4 * 2 * d_model * d_ff)
    assert row != 4 * 2 * d_model * d_ff               # the padding is exercised
    spec = ModelSpec(moe_layers=layers, d_model=d_model, d_ff=d_ff, num_experts=experts,
                     tokens=tokens, dtype="float32")
    cache = slots * 4 * row
    read, written = disk_traffic(spec, cache)
    records = layers * experts
    assert written == 3 * records * row
    want_rows = 0 if saved is None else records + 3 * records - saved   # all 8 experts used
    assert read == want_rows * row
    assert cache_saved_rows(slots, records) == (float("inf") if saved is None else saved)
    moved = _store_traffic(spec, tmp_path, cache, 8)
    steady = moved[1:]                                    # the first step fills the cache
    assert read in [m[0] for m in steady], moved
    assert written in [m[1] for m in steady], moved
    mean_read = sum(m[0] for m in steady) / len(steady)     # what a step time pays for
    assert abs(mean_read - read) <= 0.15 * read + row, moved
    for got_read, got_written in steady:
        assert abs(got_read - read) <= 0.6 * read + row, moved
        assert abs(got_written - written) <= 0.4 * written, moved


@pytest.mark.slow
@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("bf16", "int8")])
def test_deferred_disk_traffic_counts_the_gradient_rows(tmp_path, master, moments):
    """Deferred steps on a real disk-tier store (2 layers x 8 experts, a cache of N/4 records)
    write what planner.disk_traffic(..., "deferred") says (the state rows and every used
    expert's gradient row; exactly, or 1-2 rows fewer when a record stays cached from its
    backward to its step) and read within 25% of it (the forward's masters, the
    backward's masters, then master + moments + gradient for the step). Measured: bf16 +
    int8 within 1%; fp32 17% more, some records read twice when the step and the read-ahead
    compete for four slots."""
    from moescale.offload.planner import disk_traffic
    layers, d_model, d_ff, experts, tokens = 2, 48, 200, 8, 128
    spec = ModelSpec(moe_layers=layers, d_model=d_model, d_ff=d_ff, num_experts=experts,
                     tokens=tokens, dtype="float32", master=master, moments=moments)
    cache = 4 * spec.geometry().total
    read, written = disk_traffic(spec, cache, "deferred")
    eager_read, eager_written = disk_traffic(spec, cache)
    assert read > eager_read and written > eager_written
    moved = _store_traffic(spec, tmp_path, cache, 5, step_mode="deferred", master=master,
                           moments=moments)
    steady = moved[1:]
    for _, got_written in steady:   # exact when no gradient row stays cached to its step
        assert abs(got_written - written) <= 0.1 * written, moved
    mean_read = sum(m[0] for m in steady) / len(steady)
    assert abs(mean_read - read) <= 0.25 * read, moved


def test_disk_writes_are_charged_no_faster_than_cold_reads():
    """A write probe faster than the cold read (a burst into a cache) is charged at the read
    rate; a slower one (most SSDs) as it is."""
    from dataclasses import replace
    from moescale.offload.planner import disk_seconds
    fast_writes = replace(A100_NODE, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=4e9)
    assert disk_seconds(4e9, 2e9, fast_writes) == (2.0, 1.0)
    slow_writes = replace(A100_NODE, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9)
    assert disk_seconds(4e9, 2e9, slow_writes) == (2.0, 2.0)
    spec = ModelSpec(num_experts=64, **ESMOE)
    budgets = Budgets(device_bytes=1 << 50, host_bytes=1 << 50, disk_bytes=1 << 50,
                      host_cache_bytes=1 << 30)
    est = estimate(spec, budgets, fast_writes, "disk")
    read, written = disk_traffic(spec, 1 << 30)
    assert est.parts["disk_s"] == pytest.approx((read + written) / 2e9)


def test_disk_traffic_with_accumulation_adds_master_and_gradient_rows():
    from moescale.offload.direct_io import align_up
    from moescale.offload.planner import disk_traffic
    spec = ModelSpec(moe_layers=2, d_model=64, d_ff=256, num_experts=8, tokens=4,
                     micro_batches=3, dtype="float32")
    row = align_up(4 * spec.expert_params)
    used, records = 2 * 8, 16          # 4 tokens x top-2 reach all 8 experts at most
    read, written = disk_traffic(spec, 0)
    assert read == (3 * used + 3 * records + 2 * 2 * used) * row
    assert written == (3 * records + 2 * used) * row
    one = ModelSpec(moe_layers=2, d_model=64, d_ff=256, num_experts=8, tokens=2,
                    dtype="float32")               # 2 tokens x top-2: 4 experts used per layer
    assert disk_traffic(one, 0) == ((2 * 4 + 3 * records) * row, 3 * records * row)


def test_disk_step_is_the_max_of_compute_and_the_disk_on_a_cpu():
    from dataclasses import replace
    spec = ModelSpec(num_experts=16, **ESMOE)
    budgets = Budgets(device_bytes=40 * GB, host_bytes=512 * GB, disk_bytes=4096 * GB,
                      host_cache_bytes=GB)
    cpu = replace(A100_NODE, overlap=False)
    host = estimate(spec, budgets, cpu, "host")
    disk = estimate(spec, budgets, cpu, "disk")
    assert disk.step_s == pytest.approx(max(host.step_s, disk.parts["disk_s"]))
    read, write = disk.parts["disk_read_bytes_per_step"], disk.parts["disk_write_bytes_per_step"]
    assert disk.parts["disk_s"] == pytest.approx(read / cpu.disk_read_bytes_per_s +
                                                 write / cpu.disk_write_bytes_per_s)
    slow = replace(cpu, disk_read_bytes_per_s=1e6, disk_write_bytes_per_s=1e6)
    assert estimate(spec, budgets, slow, "disk").step_s == pytest.approx((read + write) / 1e6)


def test_measured_rates_are_medians_of_warm_samples(tmp_path):
    """Not a speed test: every probe is sampled warmup + runs times and the rate is the median
    of the samples after the warm-ups (the disk through a real file)."""
    import statistics
    from moescale.offload.rates import RateProbes
    sizes = dict(gemm_rows=8, d_model=16, d_ff=32, expert_params=1 << 12, copy_bytes=1 << 14)
    with RateProbes(disk_dir=str(tmp_path), disk_file_bytes=1 << 20, **sizes) as probes:
        for _ in range(5):
            probes.sample()
        rates = probes.rates(skip=2)
        with pytest.raises(ValueError, match="skip"):
            probes.rates(skip=0)
    for name in ("flops_per_s", "adam_params_per_s", "copy_bytes_per_s",
                 "disk_read_bytes_per_s", "disk_write_bytes_per_s"):
        assert len(rates.samples[name]) == 3
    assert rates.flops_per_s == statistics.median(rates.samples["flops_per_s"])
    assert rates.disk_read_bytes_per_s == statistics.median(
        rates.samples["disk_read_bytes_per_s"])
    assert rates.h2d_bytes_per_s == rates.d2h_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []          # the probe file is gone


def test_compact_formats_count_their_bytes():
    """The planner counts a format's rows: per eager step the forward's master reads, the
    state rows read and written (bf16 + int8: 10.06 bytes per parameter, fp32: 28), and a compact
    host store without its gradient rows between eager steps."""
    base = dict(moe_layers=2, d_model=1024, d_ff=4096, num_experts=64, tokens=4096,
                dtype="float32")
    params = 2 * 64 * 2 * 1024 * 4096
    per_param = {}
    for master, moments in (("fp32", "fp32"), ("bf16", "int8"), ("fp32", "int8")):
        spec = ModelSpec(**base, master=master, moments=moments)
        read, written = disk_traffic(spec, 0)
        per_param[master, moments] = (read + written) / params
    assert per_param["fp32", "fp32"] == pytest.approx(28.0, rel=1e-3)
    assert per_param["bf16", "int8"] == pytest.approx(10.06, rel=2e-3)
    assert per_param["fp32", "int8"] == pytest.approx(16.06, rel=2e-3)
    budgets = Budgets(device_bytes=1 << 40, host_bytes=1 << 40, disk_bytes=1 << 40)
    host = {fmt: estimate(ModelSpec(**base, master=fmt[0], moments=fmt[1]), budgets, A100_NODE,
                          "host").host_bytes for fmt in (("fp32", "fp32"), ("bf16", "int8"))}
    assert host["fp32", "fp32"] / host["bf16", "int8"] == pytest.approx(16 / 4.03, rel=1e-2)
    with pytest.raises(ValueError, match="moments='int4' is unknown"):
        ModelSpec(**base, moments="int4")
