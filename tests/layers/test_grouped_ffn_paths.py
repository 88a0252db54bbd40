"""The grouped kernels' execution paths all equal the reference: expert worker threads, chunks
that split one expert's rows, the gather-combine of tokens with fewer rows (capacity drops),
and the gate logits that keep a bf16 input (not an fp32 copy) for backward.

The suite runs with one intra-op thread (conftest); the worker-thread path needs two, so the
tests that cover it raise the count for their duration. Chunk splitting is forced by lowering
the chunk size constants (tiny tensors never reach the real 16 MiB chunks).

Legend: T tokens, D model width, E experts.
"""

from __future__ import annotations

import pytest
import torch

import moescale.layers.grouped_ffn as grouped_ffn
from moescale import MoE
from moescale.layers.expert_threads import balance_experts, num_expert_workers, usable_cpus

D_MODEL, D_FF = 16, 32
VARIANTS = [pytest.param(dict(glu=False, bias=False), id="ffn"),
            pytest.param(dict(glu=False, bias=True), id="ffn-bias"),
            pytest.param(dict(glu=True, activation="silu"), id="glu")]
CAPACITY = [pytest.param(None, id="dropless"), pytest.param(0.75, id="cap0.75")]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_chunks(monkeypatch):
    monkeypatch.setattr(grouped_ffn, "CHUNK_BYTES", 4 * D_FF * 3)   # 3-row chunks
    monkeypatch.setattr(grouped_ffn, "MIN_CHUNK_ROWS", 1)
    # backward's elementwise work in 2-row blocks: a chunk of 3 rows has a partial block
    monkeypatch.setattr(grouped_ffn, "ELEMENTWISE_BYTES", 4 * D_FF * 2)
    monkeypatch.setattr(grouped_ffn, "MIN_ELEMENTWISE_ROWS", 1)


def build(capacity_factor, **kw) -> MoE:
    torch.manual_seed(0)
    return MoE(D_MODEL, 6, 2, d_ff=D_FF, capacity_factor=capacity_factor, **kw)


def make_input(tokens=40) -> torch.Tensor:
    return torch.randn(tokens, D_MODEL, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("capacity_factor", CAPACITY)
@pytest.mark.parametrize("kw", VARIANTS)
def test_worker_threads_match_reference(moe_helpers, two_threads, kw, capacity_factor):
    moe = build(capacity_factor, **kw)
    # two workers where the machine has two CPUs for them (on one CPU: serial)
    assert num_expert_workers(torch.device("cpu"), [1] * 6) == (2 if usable_cpus() >= 2 else 0)
    moe_helpers.check_against_reference(moe, make_input())
    assert torch.get_num_threads() == 2   # the caller's thread count is restored


@pytest.mark.parametrize("threads", [pytest.param(1, id="serial"), pytest.param(2, id="workers")])
@pytest.mark.parametrize("capacity_factor", CAPACITY)
@pytest.mark.parametrize("kw", VARIANTS)
def test_split_chunks_match_reference(moe_helpers, tiny_chunks, kw, capacity_factor, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        moe_helpers.check_against_reference(build(capacity_factor, **kw), make_input())
    finally:
        torch.set_num_threads(before)


def test_worker_threads_bf16_match_reference_loosely(moe_helpers, two_threads):
    moe = build(None, glu=True, activation="silu").to(torch.bfloat16)
    twin = moe_helpers.fp32_twin(moe, lambda: build(None, glu=True, activation="silu"))
    moe_helpers.check_against_reference(moe, make_input().bfloat16(), ref_moe=twin,
                                        rtol=moe_helpers.BF16_RTOL)


def test_worker_errors_reach_the_caller(two_threads):
    def failing(h):
        raise RuntimeError("boom in an expert")
    moe = build(None, activation=failing)
    with pytest.raises(RuntimeError, match="boom in an expert"):
        moe(make_input())
    assert torch.get_num_threads() == 2


def test_balance_experts_is_largest_first_onto_least_loaded():
    assert balance_experts([5, 0, 3, 3, 2], 2) == [[0, 4], [2, 3]]
    assert num_expert_workers(torch.device("cpu"), [4, 0, 0, 0]) == 0


def test_gate_logits_save_the_bf16_input_not_an_fp32_copy():
    moe = build(None).to(torch.bfloat16)
    x = make_input().bfloat16().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe.router(x)
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
