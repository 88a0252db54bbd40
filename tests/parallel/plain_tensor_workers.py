"""Rank body: expert weights kept as plain tensors (not parameters) under the pipelined
expert-parallel exchange, against the single-process reference.

The shard's local container is tests/train/dict_residency.py's `DictExperts` (per held expert a
dict of leaf tensors with requires_grad, which `parameters()` does not list), which declares no
CHUNKED: the pipelined exchange runs it with the library's `AutogradChunkRunner`. Each rank
builds the same full MoE and the reference of the whole world (ep_workers), swaps the pipelined
shard's local experts for DictExperts holding the same values, and checks its output, input
and router gradients and every held expert tensor's gradient against the reference.
`declared=False` takes GRAD_TENSORS away from the container: the exchange must refuse it
(ValueError; its message is returned) instead of training it without expert gradients.
`UnnamedDictResidency` does the same to a training run (tests/train/test_unnamed_plain_tensors.py
hands it to the trainer by this file's path).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "train")]   # also when imported by path

from dict_residency import DictExperts, DictResidency  # noqa: E402
from ep_workers import _close, _full_moe, _inputs, _reference, check_layer  # noqa: E402

from moescale.dispatch.protocol import GRAD_TENSORS  # noqa: E402
from moescale.parallel.expert_parallel import shard_moe  # noqa: E402
from moescale.parallel.groups import ParallelConfig, build_groups  # noqa: E402
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher  # noqa: E402


def _dict_shard(full, groups, case: dict):
    """The pipelined shard of `full` with DictExperts (same values) as its local container."""
    moe = shard_moe(full, groups, PipelinedExpertParallelDispatcher(
        groups, case["E"], num_chunks=case["chunks"], strategy=case["strategy"]))
    old = moe.experts.local
    access = old.state_access("experts")
    local = DictExperts(old.num_experts, old.act,
                        [access.masters(l) for l in range(len(old.expert_ids))])
    if not case.get("declared", True):
        local.capabilities = local.capabilities - {GRAD_TENSORS}
    moe.experts.local = local
    return moe, local


def check_plain_tensor_experts(rank: int, world: int, cases: list[dict]) -> list:
    """[(case name, None)] per case that matched the reference; a refused case ends the run
    with (name, the error's message) (its peers stop at the same chunk)."""
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
    done = []
    for case in cases:
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, groups.ep_size)
        moe, local = _dict_shard(full, groups, case)
        try:
            check_layer(moe, full, case, xs, cs, y_ref, gx_ref, rank, groups)
        except ValueError as err:
            return done + [(case["name"], str(err))]
        ids = moe.experts.expert_ids
        for l, weights in enumerate(local.weights):
            for name, t in weights.items():
                want = getattr(full.experts, name).grad[ids.start + l]
                _close(f"expert {ids.start + l} grad {name}", t.grad, want, case)
        done.append((case["name"], None))
    return done


class UnnamedDictResidency(DictResidency):
    """DictResidency whose DictExperts do not declare GRAD_TENSORS (their tensors unnamed)."""

    def prepare(self, model, exchange):
        step = super().prepare(model, exchange)
        for experts in self.layers:
            experts.capabilities = experts.capabilities - {GRAD_TENSORS}
        return step
