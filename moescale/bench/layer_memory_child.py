"""The fresh process of one `moescale bench layer` memory measurement (layer_memory.py).

`python -m moescale.bench.layer_memory_child '<spec json>'` builds the benchmark's case
(bench/layer.py: build_candidates, same weights and input), runs the named implementation
through `layer_memory.step_rss_delta` and prints `{"impl", "rss_delta_bytes"}` as one JSON line.
It lives apart from layer_memory.py so that layer.py -> layer_memory.py has no way back.
"""

from __future__ import annotations

import json
import sys

import torch

from moescale.bench import layer
from moescale.bench.ep_memory_rank import release_freed_memory
from moescale.bench.layer_impls import Candidate, ensure_process_group
from moescale.bench.layer_memory import step_rss_delta


def child(spec: dict) -> dict:
    release_freed_memory()
    torch.set_num_threads(spec["threads"])
    opts = layer.LayerBenchOptions(**spec["options"])
    case = layer.LayerCase(**spec["case"])
    if "deepspeed" in opts.peers:
        ensure_process_group()
    moe, built = layer.build_candidates(case, layer.DTYPES[spec["dtype"]], opts)
    cand = next(c for c in built if isinstance(c, Candidate) and c.name == spec["impl"])

    def reset() -> None:
        cand.reset()
        if cand.family == "moescale":       # its kept gradient storage counts as the step's
            moe.experts.release_grad_buffers()
    return {"impl": cand.name, "rss_delta_bytes": step_rss_delta(cand.step, reset)}


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
