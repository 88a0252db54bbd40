"""Another run's complete expert-store checkpoint through the library (issue 31, item 11c).

Run A (seed 0) trains two steps with its experts offloaded and saves a store checkpoint; run B
(seed 1: the same model and layout, other initial weights) calls `engine.load_checkpoint(dir)`
with no tag. Before: A's experts loaded silently into B. Now: OtherRunError (a ValueError) in
one line naming the expert, both origins and `allow_other_run=True`, and B's store unchanged;
A rebuilt the same way (its own resume) loads it; `allow_other_run=True` loads it into B; a
checkpoint that records no origins (an older moescale's) is refused without a tag and loads
when the tag names it. Host and disk tiers.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from moescale.models.gpt import GPT, GPTConfig
from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.checkpoint import LATEST, OtherRunError


def _engine(seed: int, tier: str, directory):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_flat(vocab_size=64, seq_len=8, n_layers=2, d_model=16, n_heads=2,
                                    d_ff=32, num_experts=4, top_k=2, init_std=0.1))
    if tier == "disk":
        directory.mkdir()
    config = OffloadConfig(tier=tier, device_budget_experts=2, directory=str(directory)
                           if tier == "disk" else None, host_cache_bytes=64 << 10
                           if tier == "disk" else None)
    engine = offload_moe(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.follow(opt)
    return model, engine, opt


def _masters(engine) -> list[torch.Tensor]:
    return [engine.store.get_state(key)[0] for key in engine.store.keys()]


def _strip_origins(ckpt) -> None:
    """Make the checkpoint look like an older moescale's (no origins; a valid digest)."""
    path = os.path.join(ckpt, open(os.path.join(ckpt, LATEST)).read(), "manifest.json")
    body = json.load(open(path))["body"]
    for info in body["experts"].values():
        info.pop("origin")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with open(path, "w") as f:
        json.dump(dict(body=body, sha256=digest), f)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_another_runs_checkpoint_is_refused_unless_asked_for(tmp_path, tier):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    model, engine, opt = _engine(0, tier, tmp_path / "a")
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        idx = torch.randint(0, 64, (2, 8), generator=gen)
        _, loss = model(idx, torch.roll(idx, -1, 1))
        loss.backward()
        engine.step(), opt.step(), opt.zero_grad()
    engine.synchronize()
    saved = _masters(engine)
    engine.save_checkpoint(str(ckpt), "2")
    engine.close()

    _, other, _ = _engine(1, tier, tmp_path / "b")
    before = _masters(other)
    with pytest.raises(OtherRunError) as err:
        other.load_checkpoint(str(ckpt))                     # no tag: another run's
    text = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in text
    assert "belongs to another run" in text and "8 of 8 experts" in text
    assert "allow_other_run=True" in text and str(ckpt) in text
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(other)))   # nothing loaded
    other.load_checkpoint(str(ckpt), allow_other_run=True)   # asked for: loads
    assert all(torch.equal(a, b) for a, b in zip(saved, _masters(other)))
    other.close()

    _, own, _ = _engine(0, tier, tmp_path / "c")             # run A rebuilt: its own resume
    own.load_checkpoint(str(ckpt))
    assert all(torch.equal(a, b) for a, b in zip(saved, _masters(own)))
    own.close()

    _strip_origins(ckpt)
    _, old, _ = _engine(0, tier, tmp_path / "d")
    with pytest.raises(OtherRunError, match="records no origin.*tag="):
        old.load_checkpoint(str(ckpt))
    old.load_checkpoint(str(ckpt), tag="2")                  # named: loads
    assert all(torch.equal(a, b) for a, b in zip(saved, _masters(old)))
    old.close()
