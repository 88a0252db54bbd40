"""`torchrun --nproc-per-node 2` launches the expert-parallel layer from the environment."""

import subprocess
import sys
from pathlib import Path

import pytest

from moescale.parallel.launch import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(90)
def test_torchrun_two_ranks():
    script = Path(__file__).with_name("torchrun_script.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK rank 0 of 2" in done.stdout and "OK rank 1 of 2" in done.stdout, done.stdout
