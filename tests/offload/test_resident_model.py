"""A plain model back from an offloaded one (moescale.models.resident): after the same AdamW
steps, an offloaded GPT's `consolidated_state_dict` equals the all-resident model's state dict
up to float rounding (the same updates summed in another order: within 1e-4; measured 2e-6 on
the host tier, 1e-5 on the disk tier with GLU experts); after `resident_model` its own
`state_dict()` is exactly that full state dict (host and disk tier, GELU and GLU experts); the
restored model computes the resident logits, round-trips through torch.save and is an ordinary
module (no engine, no warning). Before that, `state_dict()` of the offloaded model warns,
naming both calls, instead of silently leaving the experts out; moescale's own savers do not
trigger the warning."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from equivalence_models import batches, make_model
from moescale.models import OffloadedExpertsWarning, consolidated_state_dict, resident_model
from moescale.models.checkpoint import save_checkpoint
from moescale.offload import OffloadConfig, offload_moe

STEPS = 3


def trained(model, offload: OffloadConfig | None):
    engine = offload_moe(model, offload) if offload is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    if engine is not None:
        engine.follow(opt)
    for step in range(STEPS):
        for idx, tgt in batches(step, 1):
            if engine is not None:
                engine.begin_micro_batch(last=True)
            model(idx, tgt)[1].backward()
        if engine is not None:
            engine.step()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier, glu", [("host", False), ("disk", True)])
def test_resident_model_gives_back_the_resident_state_after_the_same_steps(tier, glu, tmp_path):
    base = make_model(glu=glu)
    resident = trained(copy.deepcopy(base), None)
    want = resident.state_dict()
    config = OffloadConfig(tier=tier, device_budget_experts=2,
                           directory=str(tmp_path) if tier == "disk" else None)
    model = trained(copy.deepcopy(base), config)

    with pytest.warns(OffloadedExpertsWarning, match="consolidated_state_dict.*resident_model"):
        partial = model.state_dict()
    assert not any(k.endswith("_EDF") for k in partial)
    full = consolidated_state_dict(model)
    assert full.keys() == want.keys()
    for key in want:     # the same steps, summed in another order: float rounding apart
        torch.testing.assert_close(full[key], want[key], rtol=1e-4, atol=1e-4, msg=key)

    with warnings.catch_warnings():
        warnings.simplefilter("error")        # moescale's savers read the dense half quietly
        save_checkpoint(tmp_path / "ckpt.safetensors", model)
        assert resident_model(model) is model
        state = model.state_dict()            # an ordinary module now: no warning
    assert state.keys() == full.keys()
    assert all(torch.equal(state[key], full[key]) for key in full)    # exactly the store's
    torch.save(state, tmp_path / "plain.pt")
    loaded = make_model(glu=glu)
    loaded.load_state_dict(torch.load(tmp_path / "plain.pt"))
    idx, tgt = next(batches(99, 1))
    with torch.no_grad():
        resident_logits = resident(idx, tgt)[0]
        torch.testing.assert_close(model(idx, tgt)[0], resident_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(loaded(idx, tgt)[0], model(idx, tgt)[0])
