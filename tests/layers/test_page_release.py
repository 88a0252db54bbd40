"""The saved hidden's pages go back to the kernel during backward, and nothing changes for it.

`release_rows` drops the whole pages inside a row range (they read as zeros afterwards) and
keeps the partial pages at its ends; the MoE layer with release forced on (the size threshold
lowered so that a small layer qualifies) equals the reference in every output and gradient,
serially and on the expert worker threads, FFN and GLU; the release really runs then, and does
not run when the graph is kept for another backward (`retain_graph`, which must then give the
same gradients twice) or when a saved-tensor hook handed back a different buffer.

Legend: T tokens, D model width, F expert hidden width, E experts.
"""

from __future__ import annotations

import mmap

import pytest
import torch

import moescale.layers.grouped_ffn as grouped_ffn
import moescale.layers.page_release as page_release
from moescale import MoE

pytestmark = pytest.mark.skipif(page_release._madvise() is None,
                                reason="needs Linux madvise")

D_MODEL, D_FF, EXPERTS, TOKENS = 32, 1024, 4, 256   # h1: 512 rows x 4 KiB: whole pages


def test_release_rows_drops_whole_pages_only():
    page_floats = mmap.PAGESIZE // 4
    buf = torch.ones(16 * page_floats + 8)
    # 4 pages' worth of rows from mid-page: 3 whole pages inside (4 when the allocation puts
    # their start on a page boundary: counted from the addresses, not assumed)
    rows = buf[page_floats // 2: page_floats // 2 + 4 * page_floats]
    base = buf.data_ptr()
    page_release.release_rows(rows)
    start, stop = rows.data_ptr(), rows.data_ptr() + 4 * rows.numel()
    first = (-(-start // mmap.PAGESIZE) * mmap.PAGESIZE - base) // 4
    last = (stop // mmap.PAGESIZE * mmap.PAGESIZE - base) // 4
    assert last - first >= 3 * page_floats
    assert torch.all(buf[first:last] == 0), "the whole pages inside the rows read as zeros"
    assert torch.all(buf[:first] == 1) and torch.all(buf[last:] == 1), \
        "partial pages at the ends and everything outside keep their values"


@pytest.fixture
def forced_release(monkeypatch):
    """Release on for small layers; counts the bytes actually handed back per call."""
    monkeypatch.setattr(page_release, "RELEASE_MIN_BYTES", 0)
    released = []
    real = grouped_ffn.release_rows

    def counting(rows):
        if rows is not None:
            released.append(rows.numel() * rows.element_size())
        real(rows)
    monkeypatch.setattr(grouped_ffn, "release_rows", counting)
    return released


def build(glu: bool) -> MoE:
    torch.manual_seed(0)
    return MoE(D_MODEL, EXPERTS, 2, d_ff=D_FF, glu=glu,
               activation="silu" if glu else "gelu")


def make_input() -> torch.Tensor:
    return torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("threads", [pytest.param(1, id="serial"), pytest.param(2, id="workers")])
@pytest.mark.parametrize("glu", [pytest.param(False, id="ffn"), pytest.param(True, id="glu")])
def test_released_hidden_matches_reference(moe_helpers, forced_release, glu, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        moe_helpers.check_against_reference(build(glu), make_input())
    finally:
        torch.set_num_threads(before)
    hidden_bytes = TOKENS * 2 * D_FF * 4 * (2 if glu else 1)
    assert sum(forced_release) == hidden_bytes, "every row of the hidden(s) was released"


def test_kept_graph_releases_nothing_and_repeats(forced_release):
    moe, x = build(glu=True), make_input().requires_grad_(True)
    y = moe(x)
    first = torch.autograd.grad(y.square().sum(), [x, moe.experts.w1_EDF], retain_graph=True)
    assert not forced_release, "a kept graph's hidden stays whole"
    second = torch.autograd.grad(y.square().sum(), [x, moe.experts.w1_EDF])
    assert forced_release, "the last pass over the graph releases"
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_hook_copies_are_not_released(forced_release):
    moe, x = build(glu=False), make_input().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = moe(x)
    y.sum().backward()
    assert not forced_release
    y2 = moe(x)
    y2.sum().backward()
    assert forced_release, "without the hook the same layer releases"


def test_rows_path_releases_and_gives_the_same_gradients(forced_release, monkeypatch):
    """GroupedFFNRows (the seam the all-to-all dispatchers call): bitwise the same gradients
    with and without the release."""
    experts = build(glu=True).experts
    counts = (200, 0, 180, 132)
    x_RD = torch.randn(sum(counts), D_MODEL, generator=torch.Generator().manual_seed(5))

    def grads():
        x = x_RD.clone().requires_grad_(True)
        experts.forward_rows(x, counts).square().sum().backward()
        out = [x.grad] + [p.grad for p in experts.parameters()]
        experts.zero_grad(set_to_none=True)
        return out

    released = grads()
    assert forced_release
    monkeypatch.setattr(page_release, "RELEASE_MIN_BYTES", 1 << 62)
    forced_release.clear()
    kept = grads()
    assert not forced_release
    for a, b in zip(released, kept):
        assert torch.equal(a, b)
