"""Pipelined expert parallelism with offloaded experts (issue 12): the chunked all-to-all drives
`offload_moe`'s containers chunk by chunk, host and disk tiers, on 2 real gloo ranks.

- one layer call against the single-process resident layer (ReferenceMoE): output, input and
  router gradients, and every expert's gradient as accumulated in the owning rank's store,
  within 1e-5 of the reference's scale; chunks 2 and 4, strategies none, S2 and S4, grouped FFN
  and GLU experts, module experts, the keep / recompute / offload activation policies, an idle
  rank and dead experts, strategy auto (the cost model choosing among none, S2, S4 and the
  unpipelined exchange); the simulated device peak stays within its budget;
- three AdamW steps of 2 micro-batches each against single-process offloaded training of the
  same global batches: eager steps (an expert steps only after the backward of its last chunk
  of the last micro-batch) and deferred steps; losses within 1e-5 relative, expert masters and
  router within 1e-4 of their scale.
"""

from __future__ import annotations

import pytest

from moescale.parallel.launch import run_local

from pipeline_offload_workers import check_pipelined_offload, train_pipelined_offload

pytestmark = pytest.mark.distributed


def _layer_cases() -> list[dict]:
    E = 4
    return [
        dict(name="2 chunks none", E=E, top_k=2, tokens=[9, 7], chunks=2, strategy="none"),
        dict(name="4 chunks S2 recompute", E=E, top_k=2, tokens=[11, 6], chunks=4,
             strategy="S2", policy="recompute"),
        dict(name="4 chunks S4 glu", E=6, top_k=2, tokens=[9, 7], chunks=4, strategy="S4",
             glu=True),
        dict(name="2 chunks none offload policy, idle rank, dead experts", E=E, top_k=2,
             tokens=[8, 0], chunks=2, strategy="none", policy="offload", dead=(0, 3)),
        dict(name="2 chunks S2 module experts", E=E, top_k=2, tokens=[9, 7], chunks=2,
             strategy="S2", module_experts=True),
        dict(name="4 chunks none bias top1", E=E, top_k=1, tokens=[9, 5], chunks=4,
             strategy="none", bias=True),
        dict(name="2 chunks auto", E=E, top_k=2, tokens=[9, 7], chunks=2, strategy="auto"),
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pipelined_offloaded_layer_equals_resident_reference(tier, tmp_path):
    cases = _layer_cases()
    results = run_local(check_pipelined_offload, 2, (cases, tier, str(tmp_path)),
                        timeout_s=30, deadline_s=110)
    for r in results:
        assert [name for name, *_ in r.value] == [c["name"] for c in cases]
        for name, worst, peak, budget in r.value:
            assert worst <= 1e-5 and peak <= budget, (name, worst, peak, budget)


def _train_cases() -> list[dict]:
    return [
        dict(name="eager, 2 chunks none", E=4, top_k=2, tokens=6, chunks=2, strategy="none",
             step_mode="eager", steps=3),
        dict(name="eager, 4 chunks S4", E=4, top_k=2, tokens=6, chunks=4, strategy="S4",
             step_mode="eager", steps=3),
        dict(name="deferred, 4 chunks S2", E=4, top_k=2, tokens=6, chunks=4, strategy="S2",
             step_mode="deferred", steps=3),
    ]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_pipelined_offloaded_training_equals_single_process_offloaded(tier, tmp_path):
    cases = _train_cases()
    results = run_local(train_pipelined_offload, 2, (cases, tier, str(tmp_path)),
                        timeout_s=30, deadline_s=140)
    for r in results:
        assert [name for name, *_ in r.value] == [c["name"] for c in cases]
        assert all(err <= 1e-5 for *_, err in r.value), r.value
