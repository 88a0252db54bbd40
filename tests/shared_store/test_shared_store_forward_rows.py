"""The shared-store containers' base `forward_rows` is a real path, not a refusal.

`SharedStoreExperts` (computed in place on the node's host store) and `StreamedSharedExperts`
(the same store streamed through a rank's byte-budgeted device) take rows grouped by expert
through the seam's base entry point, as the placed path does with every expert owned by this
process: outputs and input gradients equal GroupedExperts' (the resident reference) on the same
weights, and each expert's gradient lands in the store's fp32 accumulator equal to the
reference's parameter gradient, in the store's layout. One process, no process group.

Legend: R rows grouped by expert, D model width.
"""

from __future__ import annotations

import pytest
import torch

from moescale.layers.grouped_ffn import PARAM_NAMES
from moescale.layers.moe import MoE
from moescale.shared_store.experts import SharedStoreExperts, shared_expert_store
from moescale.shared_store.streamed import RankDevice, StreamedSharedExperts

COUNTS = (3, 0, 5, 2)       # an expert with no rows: no gradient, accumulator untouched


def _containers(store, x):
    shared = SharedStoreExperts(store, 0, x.d_model, x.d_ff, x.act, x.glu, x.bias)
    return {"in place": shared,
            "streamed": StreamedSharedExperts.replacing(shared, store,
                                                        RankDevice(store, budget_experts=3.0))}


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("which", ["in place", "streamed"])
def test_forward_rows_of_the_node_store_is_the_resident_experts(glu, which):
    torch.manual_seed(0)
    moe = MoE(8, num_experts=4, top_k=2, d_ff=16, glu=glu, bias=not glu)
    reference = moe.experts
    store = shared_expert_store([moe])
    experts = _containers(store, reference)[which]
    x_RD = torch.randn(sum(COUNTS), 8)
    g_RD = torch.randn(sum(COUNTS), 8)

    x_ref = x_RD.clone().requires_grad_(True)
    y_ref = reference.forward_rows(x_ref, COUNTS)
    y_ref.backward(g_RD)
    x_got = x_RD.clone().requires_grad_(True)
    y_got = experts.forward_rows(x_got, COUNTS)
    y_got.backward(g_RD)

    torch.testing.assert_close(y_got, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_got.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    acc_EP = store.shared_state()[0][0][:, 1]
    for e in range(4):
        want_P = torch.cat([getattr(reference, n).grad[e].reshape(-1) for n in PARAM_NAMES
                            if getattr(reference, n) is not None])
        torch.testing.assert_close(acc_EP[e], want_P, rtol=1e-5, atol=1e-6, msg=f"expert {e}")
    assert not acc_EP[1].any()
    assert experts.owners_E is None        # the step then picks owners e % ranks
