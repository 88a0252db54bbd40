"""kill -9 of a run with compact expert state (bf16 master, int8 moments, disk tier) while its
checkpoints are written, resumed each time with `--resume`: the losses equal an uninterrupted
compact run's bit for bit (stochastic rounding is keyed by seed, expert and step, so a resumed
step rounds as the uninterrupted one), and no temp file is left."""

from __future__ import annotations

import pytest
from fault_helpers import losses
from kill_loop import kill_resume_loop, loop_args

STEPS = 24
COMPACT = dict(offload__tier="disk", offload__master="bf16", offload__moments="int8",
               offload__step_mode="eager", optim__grad_clip="0")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill9_of_a_compact_state_run_resumes_bitwise(launcher, corpus, tmp_path):
    code, text = launcher.run(loop_args(corpus, tmp_path / "ref", STEPS, **COMPACT), tmp_path)
    assert code == 0, text
    reference = losses(tmp_path / "ref")
    result = kill_resume_loop(launcher, corpus, tmp_path / "run", steps=STEPS, kills=5,
                              extra=COMPACT)
    assert result.kills == 5 and result.resumes == 5
    assert result.final_code == 0 and result.final_temps == []
    assert result.losses == reference
