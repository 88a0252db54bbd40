"""Run under torchrun: the expert-parallel layer from torchrun's environment, checked against
the single-process layer on this rank's tokens (used by test_torchrun.py)."""

import copy

import torch

from moescale.layers.moe import MoE
from moescale.parallel.grad_sync import allreduce_gradients
from moescale.parallel.groups import ParallelConfig
from moescale.parallel.setup import setup_expert_parallel


def main() -> None:
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
    print(f"OK rank {groups.rank} of {groups.world_size} err {err:.2e}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
