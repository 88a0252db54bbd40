"""The replicated dense half averaged by DDP (moescale/parallel/dense_ddp.py) at the library level.

On 2 gloo ranks, the tiny GPT with its experts split (expert parallelism) is trained twice
side by side: once wrapped in DDP (experts ignored, the dense gradients all-reduced in buckets
during backward, the expert gradients by `allreduce_gradients(..., replicated=False)`), once
with the hand-written coalesced all-reduce after backward; with gradient accumulation over 2
micro-batches (DDP's no_sync on the first), a live global-norm clip and AdamW; one bucket or
one per few parameters, the gradients views into the buckets (the trainer's) or copies. Step after step
both compute the single-process model's loss and global norm and, after the step, hold its
parameters; the DDP model's and the hand-written one's dense gradients agree to fp32 rounding.
DDP really ignores the experts (its parameters are the dense ones only) and the inner module's
state-dict keys are the model's (no `module.` prefix). A bucket size of 0 is refused.
"""

from __future__ import annotations

import pytest
import torch

from moescale.parallel.groups import ParallelConfig
from moescale.parallel.launch import run_local

STEPS, MICRO = 4, 2


def _train_worker(rank: int, world: int, bucket_mb: float, view: bool):
    import copy

    from moescale.models import gpt_config
    from moescale.models.gpt import GPT
    from moescale.parallel.dense_ddp import DDPOptions, wrap_dense_ddp
    from moescale.parallel.expert_parallel import expert_parallel_model, is_expert_parameter
    from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_
    from moescale.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=30))
    torch.manual_seed(0)
    single = GPT(gpt_config("tiny"))
    by_hand = expert_parallel_model(copy.deepcopy(single), groups)
    inner = expert_parallel_model(copy.deepcopy(single), groups)
    ddp = wrap_dense_ddp(inner, groups, DDPOptions(bucket_cap_mb=bucket_mb,
                                                   gradient_as_bucket_view=view))
    dense = {id(p) for p in inner.parameters() if not is_expert_parameter(p)}
    assert {id(p) for p in ddp._module_parameters} == dense      # what DDP reduces
    assert ddp.parameters_to_ignore and all(".experts." in n for n in ddp.parameters_to_ignore)
    assert list(inner.state_dict()) == list(by_hand.state_dict())    # no `module.`
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2)
            for name, m in (("single", single), ("hand", by_hand), ("ddp", inner))}
    gen = torch.Generator().manual_seed(7)
    mine = slice(rank * 2, rank * 2 + 2)
    out = []
    for _ in range(STEPS):
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        losses = dict(single=0.0, hand=0.0, ddp=0.0)
        for micro in range(MICRO):
            data = torch.randint(0, 256, (2 * world, 33), generator=gen)
            idx, tgt = data[:, :-1], data[:, 1:]
            loss = single(idx, tgt)[1]
            (loss / MICRO).backward()
            losses["single"] += float(loss) / MICRO
            loss = by_hand(idx[mine], tgt[mine])[1]
            (loss / MICRO).backward()
            losses["hand"] += float(loss) / MICRO
            ddp.require_backward_grad_sync = micro == MICRO - 1    # no_sync but the last
            loss = ddp(idx[mine], tgt[mine])[1]
            (loss / MICRO).backward()
            losses["ddp"] += float(loss) / MICRO
        allreduce_gradients(by_hand, groups)
        allreduce_gradients(inner, groups, replicated=False)
        grad_gap = max(float((p.grad - q.grad).abs().max())
                       for p, q in zip(inner.parameters(), by_hand.parameters()))
        norms = dict(single=float(torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05)),
                     hand=float(clip_grad_norm_(by_hand, 0.05, groups)),
                     ddp=float(clip_grad_norm_(inner, 0.05, groups)))
        for opt in opts.values():
            opt.step()
        pairs = dict(single=zip(inner.parameters(), single.parameters()),
                     hand=zip(inner.parameters(), by_hand.parameters()))
        param_gap = {name: max(float((p - q).abs().max()) for p, q in pair
                               if not is_expert_parameter(p)) for name, pair in pairs.items()}
        out.append((losses, norms, grad_gap, param_gap))
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_mb,view", [(25.0, True), (0.01, True), (25.0, False)])
def test_ddp_trains_like_the_hand_written_all_reduce_and_one_process(bucket_mb, view):
    """One bucket, one per few parameters; gradients as views into the buckets or copied."""
    ranks = [r.value for r in run_local(_train_worker, 2, (bucket_mb, view), timeout_s=30,
                                        deadline_s=110)]
    for steps in zip(*ranks):
        losses = [s[0] for s in steps]     # each rank's loss is its rows'
        for name in ("ddp", "hand"):       # the ranks' mean: the single process's
            assert sum(l[name] for l in losses) / 2 == pytest.approx(losses[0]["single"],
                                                                     rel=1e-5)
        for _, norms, grad_gap, param_gap in steps:
            assert norms["ddp"] == pytest.approx(norms["single"], rel=1e-5)
            assert norms["hand"] == pytest.approx(norms["single"], rel=1e-5)
            assert norms["single"] > 0.05        # the clip was live
            assert grad_gap < 1e-7
            # AdamW (lr 1e-2) turns rounding-sized gradient differences into larger steps
            assert param_gap["hand"] < 1e-6 and param_gap["single"] < 1e-4, param_gap


def test_a_bucket_of_no_bytes_is_refused():
    from moescale.parallel.dense_ddp import DDPOptions

    with pytest.raises(ValueError, match=r"bucket_cap_mb=0 must be > 0"):
        DDPOptions(bucket_cap_mb=0)
