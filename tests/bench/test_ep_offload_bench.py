"""`moescale bench ep-offload` on a tiny case with real gloo ranks.

Not a speed test (the ratios are the benchmark's verdict): checks that it runs end to end
through the bench CLI, times the unpipelined path and every pipelined configuration asked
for (and a `-noreuse` one: the same uploads as the reused copies and uploads of its twin),
keeps every rank's simulated device peak within its budget, and writes its JSON with the CPU
flags and the paired intervals.
"""

from __future__ import annotations

import json

import pytest

from moescale.bench import cli

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_ep_offload_times_every_configuration_within_the_device_budget(tmp_path):
    out = tmp_path / "ep_offload.json"
    code = cli.main(["ep-offload", "--tokens", "64", "--d-model", "16", "--d-ff", "32",
                     "--experts", "4", "--configs", "C2-none,C2-S4,C2-none-noreuse,Cauto-none",
                     "--runs", "2",
                     "--warmup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["unpipelined", "C2-none", "C2-S4", "C2-none-noreuse", "Cauto-none"]
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in rows.values())
    assert rows["unpipelined"]["ratio"] is None
    assert all(rows[n]["ratio"]["n"] == 2 for n in ("C2-none", "C2-S4", "C2-none-noreuse"))
    for row in rows.values():
        assert [r["device_peak_bytes"] <= r["device_budget_bytes"] for r in row["ranks"]] == \
            [True, True]
    assert [r["strategy"] for r in rows["C2-S4"]["ranks"]] == ["S4", "S4"]
    assert [r["chunks"] for r in rows["C2-S4"]["ranks"]] == [2, 2]
    picks = [r["chunks"] for r in rows["Cauto-none"]["ranks"]]   # the tuner's, the same on both
    assert picks[0] == picks[1] and picks[0] in (1, 2, 4, 8)
    for new, old in zip(rows["C2-none"]["ranks"], rows["C2-none-noreuse"]["ranks"]):
        # the chunk boundary's expert is reused, not uploaded again; -noreuse: as before
        assert new["reused"] > 0 and old["reused"] == 0
        assert new["uploads"] + new["reused"] == old["uploads"]
    assert report["peaks_within_budget"] is True and code == 0
    assert isinstance(report["cpu_flags"], list)


def test_ep_offload_refuses_a_malformed_configuration():
    for bad in ("4-none", "C2-none-reuse", "C2"):
        with pytest.raises(ValueError, match=r"C<chunks\|auto>-<strategy>"):
            cli.main(["ep-offload", "--configs", bad])
