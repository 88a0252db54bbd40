"""The block kernels' memory options equal their plain use (the pipeline relies on them).

`ffn_forward_blocks(keep_hidden=False)` (hidden only in a block buffer) gives the same outputs;
`ffn_backward_blocks` with the hidden recomputed per block (h1_RF=None) gives the same input,
weight and score gradients as with the kept hidden; `into=` accumulates weight gradients over
calls; outputs may be written over the block's own input rows (y over x, dx over gy); small
`max_rows` split an expert's rows into several blocks; serial and worker-thread paths, fp32 and
bf16 (fp32 work dtype on CPUs without fast bf16 GEMMs).

Legend: R rows, D model width, F hidden width, E experts.
"""

from __future__ import annotations

import pytest
import torch

from moescale.layers.activations import Activation
from moescale.layers.expert_threads import num_expert_workers
from moescale.layers.grouped_ffn import (FFNWeights, ffn_backward, ffn_backward_blocks,
                                         ffn_forward, ffn_forward_blocks, work_dtype)

E, D, F = 6, 8, 12
COUNTS = (5, 0, 9, 3, 4, 2)    # an expert with no row; blocks of 2 split the others
R = sum(COUNTS)
VARIANTS = [pytest.param(dict(glu=False, bias=False, act="gelu"), id="ffn"),
            pytest.param(dict(glu=False, bias=True, act="relu"), id="ffn-bias"),
            pytest.param(dict(glu=True, bias=False, act="silu"), id="glu")]


@pytest.fixture(params=[1, 2], ids=["serial", "workers"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    assert num_expert_workers(torch.device("cpu"), COUNTS) == (request.param
                                                                if request.param > 1 else 0)
    yield request.param
    torch.set_num_threads(before)


def _weights(glu, bias, dtype):
    gen = torch.Generator().manual_seed(0)

    def param(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-2 if len(shape) > 2 else -1] ** 0.5
                ).to(dtype)
    return FFNWeights(param(E, D, F), param(E, F, D), param(E, D, F) if glu else None,
                      param(E, F) if bias else None, param(E, D) if bias else None)


def _data(dtype):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(R, D, generator=gen).to(dtype), torch.randn(R, D, generator=gen).to(dtype),
            torch.rand(R, generator=gen))


def _close(a, b, dtype):
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a - b).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", VARIANTS)
def test_recompute_in_place_and_into_equal_the_plain_kernels(kw, dtype, threads):
    act, w = Activation(kw["act"]), _weights(kw["glu"], kw["bias"], dtype)
    x_RD, gy_RD, scale_R = _data(dtype)
    work = work_dtype(x_RD)
    y_ref, h1, h3 = ffn_forward(x_RD, COUNTS, w, act)
    dx_ref, gw_ref, ds_ref = ffn_backward(gy_RD, x_RD, h1, h3, COUNTS, w, act, scale_R=scale_R)

    # forward, hidden not kept, outputs written over the input rows, blocks of 2 rows
    buf = x_RD.clone()
    got_h = ffn_forward_blocks(R, COUNTS, w, act, x_rows=lambda s, t: buf[s:t].to(work),
                               y_dest=lambda s, t, n: buf[s:t], y_done=None, like=x_RD,
                               keep_hidden=False, max_rows=2)
    assert got_h == (None, None)
    _close(buf, y_ref, dtype)

    # backward, hidden recomputed, dx over the gy rows, gradients accumulated twice `into`
    into = FFNWeights(*(None if p is None else torch.zeros_like(p) for p in
                        (w.w1_EDF, w.w2_EFD, w.w3_EDF, w.b1_EF, w.b2_ED)))
    for _ in range(2):
        g_buf = gy_RD.clone()
        gw, ds = ffn_backward_blocks(
            COUNTS, w, act, None, None, x_rows=lambda s, t: x_RD[s:t].to(work),
            gy_rows=lambda s, t: g_buf[s:t].to(work), dx_dest=lambda s, t, n: g_buf[s:t],
            dx_done=None, scale_R=scale_R, need_dw=True, like=x_RD, into=into, max_rows=2)
        assert gw is into
        _close(g_buf, dx_ref, dtype)
        _close(ds, ds_ref, dtype)
    for got, want in zip((into.w1_EDF, into.w2_EFD, into.w3_EDF, into.b1_EF, into.b2_ED),
                         (gw_ref.w1_EDF, gw_ref.w2_EFD, gw_ref.w3_EDF, gw_ref.b1_EF,
                          gw_ref.b2_ED)):
        assert (got is None) == (want is None)
        if got is not None:
            _close(got, 2 * want.float(), dtype)
            assert got[1].abs().max() == 0          # the expert with no row stays zero
