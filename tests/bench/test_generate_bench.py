"""`moescale bench generate` on a tiny random model and on a trained run (not a speed test):
the record names the CPU flags, the model and the memory split; per decode token the bytes the
device read equal the store's misses (the minimum for this cache) and stay below the routed
experts' bytes; `--recompute` reads more per token than the KV cache; the expert files are
removed; a too-small --memory is refused (a trained run: tests/train/test_generate_streamed.py). No assertion depends on a timing."""

from __future__ import annotations

import json

import pytest

from moescale.bench import generate
from moescale.bench.disk_probe import cpu_flags

pytestmark = pytest.mark.timeout(180)
TINY = ["--size", "tiny", "--experts", "8", "--layers", "2", "--seq-len", "32",
        "--tokens", "20", "--probe-mb", "1"]


@pytest.mark.slow
def test_the_bench_measures_bytes_per_token_against_the_minimum(tmp_path, capsys):
    out = tmp_path / "gen.json"
    assert generate.main([*TINY, "--memory", "6MiB", "--recompute", "--dir", str(tmp_path),
                          "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["cpu_flags"] == cpu_flags() and res["model"]["num_experts"] == 8
    plan, d = res["memory_plan"], res["decode"]
    assert 2 <= plan["cached_experts"] < 16 and res["memory_bytes"] == 6 << 20
    assert d["tokens"] == 19 and 0 < d["min_read_per_token"] <= d["routed_per_token"]
    if d["device_read_per_token"]:      # 0 where the filesystem is not a block device
        assert d["device_over_min"] == pytest.approx(1.0, abs=0.01)
    recompute = res["phases"]["recompute"]
    kv = res["phases"]["decode"]["expert_uses"]
    assert recompute["decode"]["expert_uses"] > 2 * kv     # the whole window per token
    assert "decode: 19 tokens" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]           # the expert files are removed
    with pytest.raises(ValueError, match="raise --memory"):
        generate.main([*TINY, "--memory", "1MiB", "--dir", str(tmp_path), "--out", str(out)])
    assert list(tmp_path.iterdir()) == [out]           # nothing left behind
