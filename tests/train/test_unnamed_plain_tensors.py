"""A pipelined expert-parallel training run whose experts are plain tensors that the container
does not name (no GRAD_TENSORS: tests/parallel/plain_tensor_workers.py's UnnamedDictResidency,
DictResidency less that capability) is refused on its first step with the exchange's one-line
ValueError, not trained with frozen experts (2 gloo ranks, the set-up matrix's pipelined cell;
with GRAD_TENSORS the same run matches single-process training: test_dict_residency.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_setup_matrix import EXCHANGES, _config

SPEC = f"{Path(__file__).resolve().parents[1] / 'parallel' / 'plain_tensor_workers.py'}" \
       ":UnnamedDictResidency"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pipelined_run_of_unnamed_plain_tensor_experts_is_refused_in_one_line(corpus, tmp_path):
    from moescale.train.launch import train_distributed

    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, **EXCHANGES["pipelined-2"])
    with pytest.raises(RuntimeError) as err:
        train_distributed(config, run_dir, 2, quiet=True, deadline_s=90, residency=SPEC)
    line = next(x for x in str(err.value).splitlines() if "ValueError: " in x)
    assert "ValueError: DictExperts.forward_rows reads " in line, str(err.value)
    assert "that are not its parameters()" in line and "declare GRAD_TENSORS" in line, line
