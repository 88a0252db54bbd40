"""`moescale bench expert-shards` machinery on a tiny store: the three phases run in fresh gloo
processes, every expert is adopted by hard link at 1 and 2 ranks with its step count, and the
JSON holds every rank's peak, share and the CPU flags. No assertion depends on a size or time
(the tiny store is far below the processes' own memory)."""

from __future__ import annotations

import json

import pytest

from moescale.bench import expert_shards
from moescale.bench.disk_probe import cpu_flags

pytestmark = pytest.mark.distributed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_expert_shards_bench_measures_every_rank(tmp_path, monkeypatch):
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(var, "65536")        # main sets them: restored after the test
    out = tmp_path / "shards.json"
    assert expert_shards.main(["--layers", "1", "--experts", "4", "--d-model", "16", "--d-ff",
                               "32", "--tokens", "8", "--host-cache-mib", "1", "--dir",
                               str(tmp_path), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["cpu_flags"] == cpu_flags()
    assert [len(res["phases"][p]) for p in ("save", "load-1", "load-2", "consolidated")] == \
        [2, 1, 2, 2]
    for ranks in res["phases"].values():
        for f in ranks:
            assert f["peak_rss_bytes"] >= f["rss_before_bytes"] > 0 and f["share_bytes"] > 0
    assert [(a["experts"], a["adopted"]) for a in res["adopted"]] == [(4, 4), (2, 2), (2, 2)]
    assert res["loaded_steps"] == [[1.0], [1.0], [1.0]]
    assert list(tmp_path.iterdir()) == [out]     # the work directory is removed
