"""Expert weights that are plain tensors (not parameters) under the pipelined expert-parallel
exchange, on 2 real gloo ranks against the single-process reference
(tests/parallel/plain_tensor_workers.py).

The exchange's default chunk runner (`AutogradChunkRunner`, for a container without CHUNKED)
used to differentiate only `parameters()`: such experts trained with no gradient and no error.
A container that names its tensors (GRAD_TENSORS) gets every expert gradient of the reference,
under strategies none, S2 and S4; one that does not is refused in one line naming GRAD_TENSORS,
in forward (strategy none keeps the chunk's graph) or in backward (S2 re-runs the chunk).
Slow (2-rank runs of several seconds); the fast lane checks the runner itself on CPU
(tests/dispatch/test_protocol.py), and the trainer's pipelined cells of
tests/train/test_dict_residency.py train such experts to the reference's losses.
"""

from __future__ import annotations

import pytest

from moescale.parallel.launch import run_local

from plain_tensor_workers import check_plain_tensor_experts

pytestmark = [pytest.mark.distributed, pytest.mark.slow]   # the fast lane: tests/dispatch
TOKENS = [9, 4]


@pytest.mark.timeout(90)
def test_plain_tensor_experts_get_the_reference_gradients_under_pipelined_ep():
    cases = [
        dict(name="plain tensors, 2 chunks, none", E=4, top_k=2, tokens=TOKENS, chunks=2,
             strategy="none"),
        dict(name="plain tensors, glu, 3 chunks, S2", E=4, top_k=2, tokens=TOKENS, chunks=3,
             strategy="S2", glu=True),
        dict(name="plain tensors, bias, idle rank, 2 chunks, S4", E=4, top_k=2,
             tokens=[6, 0], chunks=2, strategy="S4", bias=True, dead=(0, 3)),
    ]
    results = run_local(check_plain_tensor_experts, 2, (cases,), timeout_s=20, deadline_s=80)
    for r in results:
        assert r.value == [(c["name"], None) for c in cases], r.value


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["none", "S2"])
def test_plain_tensors_not_named_are_refused_in_one_line(strategy):
    case = dict(name=f"undeclared, {strategy}", E=4, top_k=2, tokens=TOKENS, chunks=2,
                strategy=strategy, declared=False)
    results = run_local(check_plain_tensor_experts, 2, ([case],), timeout_s=20, deadline_s=80)
    for r in results:
        [(name, error)] = r.value
        assert error is not None, f"rank {r.rank}: trained without refusing"
        assert error.startswith("DictExperts.forward_rows reads ") and "\n" not in error
        assert "declare GRAD_TENSORS with grad_tensors()" in error, error
