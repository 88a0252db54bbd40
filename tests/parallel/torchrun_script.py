"""Run under torchrun: the expert-parallel layer from torchrun's environment, checked against
the single-process layer on this rank's tokens (used by test_torchrun.py). Each rank also
prints the launcher variables it was given, as one `ENV {json}` line."""

import copy
import json
import os

import torch

from moescale.layers.moe import MoE
from moescale.parallel.grad_sync import allreduce_gradients
from moescale.parallel.groups import ParallelConfig
from moescale.parallel.setup import setup_expert_parallel


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")


def say(line: str) -> None:
    """One line in one write(2) (atomic on a pipe below PIPE_BUF): the two ranks share the
    launcher's stdout, and print() under PYTHONUNBUFFERED writes the text and its newline
    apart, so two ranks' lines could interleave."""
    os.write(1, (line + "\n").encode())


def main() -> None:
    say("ENV " + json.dumps({k: os.environ.get(k) for k in LAUNCH_VARIABLES}))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(8, 4, 2, d_ff=16), torch.nn.Tanh())
    single = copy.deepcopy(model)
    groups = setup_expert_parallel(model, ParallelConfig(backend="gloo", timeout_s=30,
                                                         chunks=2, reuse="S4"))
    x = torch.randn(5 + groups.rank, 8, generator=torch.Generator().manual_seed(groups.rank))
    y = model(x)
    y.sum().backward()
    allreduce_gradients(model, groups)
    err = (y - single(x)).abs().max().item()
    assert err < 1e-5, err
    say(f"OK rank {groups.rank} of {groups.world_size} err {err:.2e}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
