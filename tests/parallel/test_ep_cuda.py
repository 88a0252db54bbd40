"""Expert parallelism on CUDA with NCCL (skipped without a GPU): one rank per GPU, every reuse
strategy and a few chunk counts against the single-process layer on the same GPU.

With one GPU this runs a world of 1 (the exchanges are still real NCCL all-to-alls); with
more, one rank per GPU up to 4.
"""

import pytest
import torch

from moescale.parallel.launch import run_local

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_rank(rank: int, world: int) -> list[str]:
    from moescale.layers.moe import MoE
    from moescale.parallel.expert_parallel import shard_moe
    from moescale.parallel.grad_sync import allreduce_gradients
    from moescale.parallel.groups import ParallelConfig, build_groups
    from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

    groups = build_groups(ParallelConfig(backend="nccl", timeout_s=60))
    dev = torch.device("cuda", rank)
    done = []
    for chunks, strategy in [(1, "none"), (3, "S1"), (4, "S2"), (2, "S3"), (8, "S4"),
                             ("auto", "auto")]:
        torch.manual_seed(0)
        full = MoE(32, 4 * world, 2, d_ff=64, device=dev)
        disp = PipelinedExpertParallelDispatcher(groups, 4 * world, num_chunks=chunks,
                                                 strategy=strategy, memory_limit_bytes=1e9)
        ep = shard_moe(full, groups, disp)
        x = torch.randn(37 + 5 * rank, 32, device=dev)
        xe = x.clone().requires_grad_(True)
        y = ep(xe)
        (world * y.square().sum()).backward()
        allreduce_gradients(ep, groups)
        xs = x.clone().requires_grad_(True)
        y_ref = full(xs)
        y_ref.square().sum().backward()
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xe.grad / world, xs.grad, rtol=1e-4, atol=1e-5)
        ids = ep.experts.expert_ids
        if world == 1:   # the reference then holds exactly this rank's experts and tokens
            torch.testing.assert_close(ep.experts.local.w1_EDF.grad,
                                       full.experts.w1_EDF.grad[ids.start:ids.stop],
                                       rtol=1e-4, atol=1e-5)
        done.append(f"{chunks}/{strategy}")
    return done


@pytest.mark.timeout(300)
def test_nccl_pipelined_matches_single_process():
    world = min(torch.cuda.device_count(), 4)
    results = run_local(_cuda_rank, world, backend="nccl", timeout_s=60, deadline_s=280)
    assert len(results[0].value) == 6
