"""`moescale bench layer` machinery on a tiny case: every implementation runs the same work.

Not a speed test (speed lives in the benchmark's own output): checks that the floor, moescale
and the peers are built on the same weights (Hugging Face's output equals moescale's), that
rows, saved-activation bytes and target records are filled in, that the tables render and the
JSON is written, and that the bench CLI rejects an unknown benchmark with a ValueError.
DeepSpeed is an optional peer (not a project dependency): its test is skipped without it.
"""

from __future__ import annotations

import json

import pytest
import torch

from moescale.bench import cli, layer
from moescale.bench.layer_impls import ensure_process_group
from moescale.bench.measure import SavedBytes, hardware_tag, write_json

TINY = layer.LayerCase(d_model=16, d_ff=32, num_experts=4, top_k=2, num_tokens=32)


def run_tiny(peers, dtype="fp32", expert="glu", repeats=1, memory=False):
    opts = layer.LayerBenchOptions(peers=peers, repeats=repeats, dtypes=[dtype], expert=expert,
                                   memory=memory)
    return layer.run_case("tiny", TINY, dtype, opts, log=lambda msg: None)


def test_floor_moescale_and_naive_loop_rows_saved_bytes_and_targets():
    rows, skipped = run_tiny([])
    assert not skipped
    names = [r["impl"] for r in rows]
    assert names == ["floor: 1 dense FFN", "floor: 4 FFNs, even split", "moescale",
                     "naive loop (masks + index_add_)", "bound: routing + data movement"]
    ours, naive = rows[2], rows[3]
    assert ours["rows"] == TINY.num_tokens * TINY.top_k and ours["runs"] == 1
    assert ours["saved_bytes"] > 0 and 0.9 < ours["saved_ratio"] < 1.5
    assert naive["rows"] == ours["rows"] and naive["max_abs_diff"] < 1e-5   # same layer
    assert max(r["ratio_to_floor"] for r in rows if r["family"] == "floor") == 1.0
    checks = layer.check_targets(rows, TINY)
    assert checks[0]["what"].startswith("moescale step time <= 1.05 x floor")
    assert any(c["what"] == "moescale faster than naive loop (masks + index_add_) (rows/s)"
               for c in checks)
    table, md = layer.format_table(rows), layer.format_markdown(rows)
    assert "moescale" in table and md.count("\n") == len(rows) + 1


@pytest.mark.slow
def test_gelu_experts_paired_intervals_and_rss_in_fresh_processes():
    """--expert ffn (GELU), two repeats (paired ratios with an interval), and the peak RSS
    delta measured per implementation in its own process (Linux), compared to the dense
    floor's."""
    rows, _ = run_tiny([], expert="ffn", repeats=2, memory=True)
    ours = next(r for r in rows if r["family"] == "moescale")
    assert ours["expert"] == "ffn"
    ci = ours["time_vs_floor"]
    assert ci["n"] == 2 and ci["low"] <= ci["ratio"] <= ci["high"]
    bound = ours["floor_plus_movement"]      # (floor + routing and movement) / floor
    assert bound["n"] == 2 and bound["ratio"] > 1.0
    assert layer.check_targets(rows, TINY)[0]["bound"] == bound
    assert ours["time_vs_naive"]["n"] == 2
    if ours["rss_delta_bytes"] is None:
        pytest.skip("no /proc/self/clear_refs here")
    assert all(r["rss_delta_bytes"] >= 0 for r in rows if r["family"] != "bound")
    checks = layer.check_targets(rows, TINY)
    assert any(c["what"].startswith("moescale peak RSS delta") for c in checks)


def test_result_records_cpu_flags_and_gemm_choice():
    opts = layer.LayerBenchOptions(configs=[], dtypes=["fp32", "bf16"], peers=[], memory=False)
    result = layer.run(opts, [], log=lambda msg: None)
    assert isinstance(result["cpu_flags"], list)
    assert set(result["gemm"]) == {"fp32", "bf16"}
    assert result["gemm"]["fp32"]["kernels"] == "native"
    with pytest.raises(ValueError, match="--expert"):
        layer.LayerBenchOptions(expert="moe")


@pytest.mark.slow
def test_hf_peers_get_moescales_weights():
    pytest.importorskip("transformers")
    rows, skipped = run_tiny(["hf"])
    assert not skipped
    hf = [r for r in rows if r["impl"].startswith("hf mixtral")]
    assert {r["impl"] for r in hf} == {"hf mixtral (eager)", "hf mixtral (grouped_mm)",
                                       "hf mixtral (batched_mm)"}
    for r in hf:
        assert r["max_abs_diff"] < 1e-5, r


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_deepspeed_peer_counts_kept_rows():
    pytest.importorskip("deepspeed")
    created = ensure_process_group()
    try:
        rows, skipped = run_tiny(["deepspeed"])
    finally:
        if created:
            import torch.distributed as dist
            dist.destroy_process_group()
    ds = {r["impl"]: r for r in rows if r["impl"].startswith("deepspeed")}
    assert ds["deepspeed-moe (cf 1)"]["rows"] <= TINY.num_tokens * TINY.top_k
    assert ds["deepspeed-moe (cf 2)"]["rows"] >= ds["deepspeed-moe (cf 1)"]["rows"]


def test_saved_bytes_count_each_storage_once_and_skip_parameters():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedBytes(exclude=[w]) as probe:
        y = (x @ w) * x.sum()
    # mm saves x (and w, a parameter); mul saves x @ w and the 0-d sum: 128 + 128 + 4 bytes
    assert probe.nbytes == 4 * 8 * 4 + 4 * 8 * 4 + 4
    del y


def test_json_and_cli(tmp_path):
    path = tmp_path / "sub" / f"layer_{hardware_tag(torch.device('cpu'))}.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temp file left
    with pytest.raises(ValueError, match="unknown"):
        cli.main(["nope"])
    with pytest.raises(ValueError, match="--configs"):
        layer.LayerBenchOptions(configs=["d7"])
