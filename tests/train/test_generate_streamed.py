"""Generation from a run whose experts stay offloaded (moescale.train.streamed, gen_stats, the
`moescale generate` options) on a real disk-tier `moescale train` run: resident, host-tier and
disk-tier loads decode the greedy tokens of the resident model's full recompute; the disk tier
adopts the checkpoint's records (nothing written, the checkpoint intact, its directory removed
on close) and, within a `memory` bound, reads per token only the routed experts its host cache
lacks (every expert at most once when the cache holds them all); a too-small bound is refused
naming the need; the command prints the continuation on stdout and the per-phase figures on
stderr, batches several prompts (each the continuation it gets alone), and the end-of-run
sample (its training cache's slots holding masters alone: every expert read once; the resident
model's tokens) has its figures in summary.json; `moescale bench generate --run` streams the run; next-layer
prefetch changes what is read, not the tokens; a corrupt master row in the newest checkpoint
streams the previous one (its store directory removed), a corrupt moment row does not matter
(generation reads and verifies masters only); the store a kill -9 left behind is removed
by the next load (a live one is kept); experts compute from the cached masters in place (the
copies' logits, nothing uploaded); a run without its initial checkpoint rewrites its records in
place and generates from its only checkpoint."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch

import moescale
from moescale import cli
from moescale.train.gen_stats import GenerationMeter
from moescale.train.streamed import memory_plan, open_run
from moescale.train.trainer import Trainer
from train_helpers import tiny_run_config

pytestmark = pytest.mark.timeout(180)
IDX = torch.tensor([list(b"def f"), list(b"class")])


@pytest.fixture(scope="module")
def disk_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    config = tiny_run_config(corpus, run_dir, steps=2, every=2, keep_last=1, **{
        "model.glu": "true", "model.activation": "silu", "offload.tier": "disk",
        "offload.step_mode": "eager", "optim.grad_clip": "0", "train.sample_tokens": "20",
        "offload.host_cache_bytes": "192KiB"})     # two whole records, eight masters
    assert Trainer(config, run_dir, out=open("/dev/null", "w")).run() == 0
    model, _ = moescale.load_run(run_dir)
    return run_dir, model.generate(IDX, 40, temperature=0, kv_cache=False)


@pytest.mark.parametrize("experts,cached", [  # the fast lane keeps the disk tier in a bound
    pytest.param("resident", None, marks=pytest.mark.slow),
    pytest.param("host", None, marks=pytest.mark.slow),
    pytest.param("disk", None, marks=pytest.mark.slow), ("disk", 2)])
def test_every_residency_decodes_the_resident_recompute_tokens(disk_run, experts, cached):
    run_dir, want = disk_run
    memory = None if cached is None else memory_for(run_dir, cached, batch=2)
    with _quiet():
        run = open_run(run_dir, experts=experts, memory=memory, batch=2)
    with run:
        assert torch.equal(run.model.generate(IDX, 40, temperature=0), want)
        directory = run.directory
        if experts == "disk":
            assert run.engine.store.bytes_written == 0      # records adopted, not copied
            assert directory.parent == run_dir and directory.is_dir()
    assert directory is None or not directory.exists()
    model, _ = moescale.load_run(run_dir)                   # the checkpoint is intact
    assert torch.equal(model.generate(IDX, 2, temperature=0), want[:, :7])


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():      # tmpfs refuses O_DIRECT: the store warns
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def meta_model(run_dir):
    """The run's GPT on the meta device (byte vocabulary)."""
    from moescale.train.load_run import run_config
    from moescale.train.model import build_model

    with torch.device("meta"):
        return build_model(run_config(run_dir), 256)


def memory_for(run_dir, cached_experts: int, batch: int = 1) -> int:
    """The `memory` whose host cache holds `cached_experts` experts of the run's model."""
    plan = memory_plan(meta_model(run_dir), 1 << 40, batch=batch)
    return plan.dense + plan.kv_cache + plan.device_copies + cached_experts * plan.master_bytes


def measure(run_dir, memory: int) -> dict:
    with _quiet(), open_run(run_dir, experts="disk", memory=memory) as run:
        meter = GenerationMeter(run.model, run.engine)
        run.model.generate(IDX[:1], 25, temperature=0, on_token=meter.on_token)
        s = meter.summary()
        s["cached"] = run.plan.cached_experts
        s["store_read"] = run.engine.store.bytes_read
    return s


def test_the_disk_tier_reads_only_routed_experts_missing_from_the_host_cache(disk_run):
    run_dir, _ = disk_run
    small = measure(run_dir, memory_for(run_dir, 3))      # 3 of the 8 experts
    assert small["cached"] == 3
    for phase in ("prefill", "decode"):
        p = small[phase]
        assert 0 < p["expert_reads"] <= p["expert_uses"]
    assert small["store_read"] == small["master_bytes"] * sum(
        small[p]["expert_reads"] for p in ("prefill", "decode"))
    big = measure(run_dir, memory_for(run_dir, 8))        # all: each read at most once
    assert big["cached"] == 8
    assert big["prefill"]["expert_reads"] + big["decode"]["expert_reads"] <= 8
    assert big["decode"]["hit_rate"] > 0.9 and big["decode"]["tokens"] == 24


def test_memory_bounds_are_checked(disk_run, capsys):
    run_dir, _ = disk_run
    with torch.device("meta"):
        model = moescale.models.GPT(moescale.models.GPTConfig.from_flat(
            vocab_size=256, seq_len=32, n_layers=2, d_model=32, n_heads=2, d_ff=64,
            num_experts=4, glu=True))
    plan = memory_plan(model, 1 << 20, batch=1)
    assert plan.dense + plan.kv_cache + plan.device_copies + plan.host_cache <= 1 << 20
    with pytest.raises(ValueError, match="too small for this model.*raise --memory"):
        memory_plan(model, 64 << 10, batch=1)
    assert cli.main(["generate", str(run_dir), "--prompt", "x", "--memory", "1KiB"]) == 2
    assert "raise --memory" in capsys.readouterr().err
    assert cli.main(["generate", str(run_dir), "--prompt", "x", "--experts", "host",
                     "--memory", "1MiB"]) == 2
    assert "--experts disk" in capsys.readouterr().err


def test_the_command_streams_batches_and_reports(disk_run, capsys):
    run_dir, want = disk_run
    args = ["generate", str(run_dir), "--tokens", "20", "--temperature", "0",
            "--memory", "1MiB"]
    with _quiet():
        assert cli.main(args + ["--prompt", "def f"]) == 0
    out, err = capsys.readouterr()
    assert out == bytes(want[0, 5:25].tolist()).decode("utf-8", errors="replace") + "\n"
    assert "experts: disk (dense" in err and "decode: 19 positions, 19 tokens" in err
    assert "host cache hit rate" in err and "peak RSS" in err
    with _quiet():
        assert cli.main(args + ["--prompt", "def f", "--prompt", "x", "--prompt",
                                "class"]) == 0
    out = capsys.readouterr().out
    with _quiet():
        assert cli.main(args + ["--prompt", "x"]) == 0
    alone = capsys.readouterr().out
    texts = [bytes(row[5:25].tolist()).decode("utf-8", errors="replace") for row in want]
    assert out == f"[0]\n{texts[0]}\n[1]\n{alone}[2]\n{texts[1]}\n"


def test_the_end_of_run_sample_caches_masters_and_reports_its_figures(disk_run):
    run_dir, _ = disk_run
    summary = json.loads((run_dir / "summary.json").read_text())
    stats = summary["sample_stats"]
    assert stats["prefill"]["forwards"] == 1 and stats["decode"]["tokens"] == 19
    assert stats["master_bytes"] > 0 and stats["decode"]["peak_rss"] > 0
    # training's two record slots hold all eight masters while it samples: each is read once
    assert stats["prefill"]["expert_reads"] + stats["decode"]["expert_reads"] <= 8
    assert stats["decode"]["hit_rate"] > 0.85
    model, config = moescale.load_run(run_dir)      # the resident model samples the same
    out = model.generate(torch.tensor([list(b"def ")]), 20, temperature=0.8, top_k=40,
                         generator=torch.Generator().manual_seed(config.train.seed))
    assert summary["sample"] == bytes(out[0].tolist()).decode("utf-8", errors="replace")


@pytest.mark.slow
def test_the_bench_streams_a_trained_run(disk_run, tmp_path):
    from moescale.bench import generate

    run_dir, _ = disk_run
    out = tmp_path / "gen.json"
    assert generate.main(["--run", str(run_dir), "--memory", str(memory_for(run_dir, 3)),
                          "--tokens", "12", "--probe-mb", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["source"] == str(run_dir) and res["memory_plan"]["cached_experts"] == 3
    assert res["decode"]["tokens"] == 11 and res["decode"]["min_read_per_token"] > 0
    assert not list(run_dir.glob(".generate-store-*"))     # its store directory is removed


@pytest.mark.slow
def test_next_layer_prefetch_changes_reads_not_tokens(disk_run):
    from moescale.train.streamed import NextLayerPrefetch

    run_dir, want = disk_run
    with _quiet(), open_run(run_dir, experts="disk", memory=memory_for(run_dir, 3, 2),
                            batch=2) as run:
        prefetch = NextLayerPrefetch(run.model, run.engine)
        got = run.model.generate(IDX, 40, temperature=0)
        prefetch.close()
        assert torch.equal(got, want)
        assert prefetch.predicted >= 40 and 0 <= prefetch.correct <= prefetch.predicted
        assert not any(m._forward_hooks for m in prefetch.moes)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_streams_the_previous_one(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = tiny_run_config(corpus, run_dir, steps=4, every=2, keep_last=2, **{
        "offload.tier": "disk", "offload.step_mode": "eager", "optim.grad_clip": "0"})
    assert Trainer(config, run_dir, out=open("/dev/null", "w")).run() == 0
    newest, _ = moescale.load_run(run_dir)
    want4 = newest.generate(IDX, 10, temperature=0, kv_cache=False)
    want2 = moescale.load_run(run_dir, step=2)[0].generate(IDX, 10, temperature=0,
                                                           kv_cache=False)
    record = next((run_dir / "checkpoints" / "expert-shards-00000004").rglob("*.bin"))
    experts = meta_model(run_dir).blocks[0].ffn.experts
    numel = sum(p.numel() for p in experts.parameters()) // experts.num_experts
    stride = 4096 * -(-4 * numel // 4096)     # a record's row, 4 KiB-aligned

    def corrupt(offset):
        with open(record, "r+b") as f:
            f.seek(offset)
            f.write(bytes(8) if f.read(8) != bytes(8) else b"\x01" * 8)

    memory = memory_for(run_dir, 3, 2)
    corrupt(stride + 100)        # a moment row: generation reads and verifies masters only
    with _quiet(), open_run(run_dir, experts="disk", memory=memory, batch=2) as run:
        assert torch.equal(run.model.generate(IDX, 10, temperature=0), want4)
    assert "previous checkpoint" not in capsys.readouterr().err
    corrupt(100)                 # the master row: the newest checkpoint is refused
    with _quiet(), open_run(run_dir, experts="disk", memory=memory, batch=2) as run:
        assert torch.equal(run.model.generate(IDX, 10, temperature=0), want2)
    assert "trying the previous checkpoint" in capsys.readouterr().err
    assert not list(run_dir.glob(".generate-store-*"))


@pytest.mark.slow
def test_a_killed_generation_leaves_a_store_the_next_one_removes(disk_run):
    import os
    import signal
    import subprocess
    import sys
    import time

    from moescale.train.streamed import remove_stale_stores

    run_dir, _ = disk_run
    proc = subprocess.Popen([sys.executable, "-m", "moescale", "generate", str(run_dir),
                             "--prompt", "def ", "--tokens", "100000", "--memory", "1MiB",
                             "--threads", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(run_dir.glob(".generate-store-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        stale = list(run_dir.glob(".generate-store-*"))
        assert stale and stale[0].name.startswith(f".generate-store-{proc.pid}-")
        assert remove_stale_stores(run_dir) == []           # its process is alive: kept
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert list(run_dir.glob(".generate-store-*")) == stale   # kill -9: nothing cleaned up
    with _quiet(), open_run(run_dir, experts="disk", memory=memory_for(run_dir, 3)) as run:
        assert [p.name for p in run_dir.glob(".generate-store-*")] == [run.directory.name]
    assert not list(run_dir.glob(".generate-store-*"))


def test_a_run_without_its_initial_checkpoint_rewrites_records_in_place(corpus, tmp_path):
    """`train.initial_checkpoint false` (a run near the disk's size): no step-0 checkpoint, so
    the first step rewrites each record file in place (one file per expert, no copy beside the
    initial masters) and the run generates from its only checkpoint."""
    run_dir = tmp_path / "run"
    config = tiny_run_config(corpus, run_dir, steps=1, every=1, keep_last=1, **{
        "offload.tier": "disk", "offload.master": "fp32", "offload.moments": "int8",
        "offload.step_mode": "eager", "optim.grad_clip": "0",
        "train.initial_checkpoint": "false"})
    assert Trainer(config, run_dir, out=open("/dev/null", "w")).run() == 0
    assert [p.name for p in (run_dir / "checkpoints").glob("ckpt_*")] == \
        ["ckpt_00000001.safetensors"]
    files = list((run_dir / "expert-store").rglob("*.bin"))
    assert len(files) == 8 and all(f.name.endswith(".g0.bin") for f in files)
    want = moescale.load_run(run_dir)[0].generate(IDX, 10, temperature=0, kv_cache=False)
    with _quiet(), open_run(run_dir, experts="disk", memory=memory_for(run_dir, 3, 2),
                            batch=2) as run:
        assert torch.equal(run.model.generate(IDX, 10, temperature=0), want)


def test_walks_compute_from_the_cached_masters_in_place(disk_run):
    """On a CPU device with fp32 masters nothing is copied per expert (DeviceCache.borrow):
    the same logits as with the copies, and every borrowed slot is given back."""
    run_dir, want = disk_run
    with _quiet(), open_run(run_dir, experts="disk", memory=memory_for(run_dir, 3, 2),
                            batch=2) as run:
        cache, device = run.engine.cache, run.engine.cache.device
        assert cache.borrow
        before = device.bytes_uploaded
        with torch.no_grad():
            borrowed = run.model(IDX)[0]
            assert device.bytes_uploaded == before
            assert all(e.pins == 0 for e in run.engine.store.disk._cache.values())
            cache.borrow = False
            copied = run.model(IDX)[0]
            assert device.bytes_uploaded > before
        assert torch.equal(borrowed, copied)
        cache.borrow = True
        assert torch.equal(run.model.generate(IDX, 40, temperature=0), want)
