"""`moescale train --parallel.placement dynamic --offload.mode host|disk` on 2 gloo ranks.

The node's experts live in one store shared by both ranks (host tier: /dev/shm; disk tier:
record files under the run's expert-store/node0/); every MoE call places them by LPT (+ hot
expert splitting) and each rank streams the experts placed on it through its own device budget.
Checked here: the offload options it cannot serve are refused, naming the fix. Twenty steps equal
to single-process resident training, the device budgets, shards, record files and hard links,
resuming on one process, on 2 dynamic ranks and straight into sampling, and a single-process
checkpoint resumed on dynamic disk-tier ranks are tests/train/test_setup_matrix.py's (dynamic
row); two micro-batches per step on the disk tier are tests/train/test_train_dynamic.py's.
"""

from __future__ import annotations

import pytest

from moescale.train.config import load_config
from moescale.train.residency import check_residency

DYNAMIC = {"parallel.placement": "dynamic"}
MODES = {"host": {"offload.mode": "host"}}


@pytest.mark.parametrize("option, value, message", [
    ("offload.mode", "pin", "use offload.tier host or disk, or offload.tier device-only"),
    ("offload.activation_policy", "offload", "use offload.activation_policy keep or recompute"),
    ("offload.step_mode", "eager", "use offload.step_mode deferred"),
])
def test_unsupported_offload_options_are_refused(option, value, message):
    overrides = dict(DYNAMIC, **dict(MODES["host"], **{option: value}))
    if option == "offload.step_mode":
        overrides["optim.grad_clip"] = "0"
    with pytest.raises(ValueError, match=message):
        check_residency(load_config(None, overrides))
