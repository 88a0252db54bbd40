"""`torchrun --nproc-per-node 2` launches the expert-parallel layer from the environment, and
gives its workers the variables tests/warm_runner.py gives the ranks it forks in torchrun's place
(the trainer's torchrun tests and the doc blocks' torchrun commands)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moescale.parallel.launch import free_port
from warm_runner import torchrun_environment

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(90)
def test_torchrun_two_ranks():
    script = Path(__file__).with_name("torchrun_script.py")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=80, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK rank 0 of 2" in done.stdout and "OK rank 1 of 2" in done.stdout, done.stdout
    given = sorted((json.loads(line[4:]) for line in done.stdout.splitlines()
                    if line.startswith("ENV ")), key=lambda e: int(e["RANK"]))
    assert len(given) == 2, done.stdout
    for rank, real in enumerate(given):
        forked = torchrun_environment({}, rank, 2, port, real["TORCHELASTIC_RUN_ID"])
        assert {k: forked.get(k) for k in real} == real, (rank, real)
