"""Training lets the experts reuse their kept gradient storage (layers/grad_buffers.py).

The trainer drops the gradients between steps (`zero_grad(set_to_none=True)`) and keeps no
reference to them, so from the second step on every stacked expert gradient is written into
the storage the layer kept: same data pointer each step, one storage per weight held (none
piling up), in fp32 and under bf16 autocast (where the layer's gradient is the bf16 one the
cast turns into the fp32 .grad).
"""

from __future__ import annotations

import os

import pytest

from moescale.layers import grad_buffers
from moescale.layers.experts import GroupedExperts
from moescale.train.trainer import Trainer
from tests.train.train_helpers import small_corpus, tiny_run_config

pytestmark = pytest.mark.skipif(grad_buffers._STORAGE_USE_COUNT is None,
                                reason="this torch exposes no storage use count")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_steps_reuse_the_expert_gradient_storage(tmp_path, precision):
    corpus = small_corpus(tmp_path / "corpus", num_files=4)
    config = tiny_run_config(corpus, tmp_path / "run", steps=4, every=0, keep_last=1,
                             **{"train.precision": precision})
    trainer = Trainer(config, tmp_path / "run", out=open(os.devnull, "w"))
    layers = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
    assert layers
    held, pointers = [], []
    for _ in range(4):
        trainer.train_step()
        held.append([m.grad_buffers.held_bytes() for m in layers])
        pointers.append([m.w1_EDF.grad.data_ptr() for m in layers])
    item = 2 if precision == "bf16" else 4
    weights = [sum(p.numel() * item for p in m.parameters()) for m in layers]
    # one kept storage per weight after every step: had any backward found its storage still
    # held, the layer would have allocated and kept a second one
    assert all(h == weights for h in held)
    if precision == "fp32":     # the layer's gradient is the .grad itself
        assert pointers[1:] == pointers[:-1]
