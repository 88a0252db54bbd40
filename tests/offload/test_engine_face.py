"""The offload engine's face and the store's two tiers (moescale/offload/engine.py,
host_tier.py, disk_tier.py): what the engine shows agrees with its parts after a real step,
on both tiers, and HostTier has every method the store calls on DiskTier, so that no code
asks which tier a store holds."""

from __future__ import annotations

import inspect

import pytest
import torch
from equivalence_models import batches, make_model

from moescale.offload import OffloadConfig, offload_moe
from moescale.offload.disk_tier import DiskTier
from moescale.offload.host_tier import HostTier
from moescale.offload.stepping import OffloadStep, dir_bytes


def _one_step(engine, model) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.follow(opt)
    (idx, tgt), = batches(0, 1)
    model(idx, tgt)[1].backward()
    engine.step(); opt.step(); opt.zero_grad()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_the_face_agrees_with_the_parts(tier, tmp_path):
    model = make_model()
    extra = dict(directory=str(tmp_path)) if tier == "disk" else {}
    engine = offload_moe(model, OffloadConfig(tier=tier, device="cpu", device_budget_experts=3,
                                              step_mode="deferred", **extra))
    try:
        _one_step(engine, model)
        assert engine.step_mode == "deferred"
        assert engine.device_budget_bytes == engine.device.budget_bytes > 0
        assert engine.num_uploads == engine.cache.num_uploads > 0
        assert engine.wait_seconds == pytest.approx(engine.cache.wait_seconds, abs=1e-3)
        engine.synchronize()
        engine.store.flush()       # no write-behind in flight: the I/O counters stand still
        memory = engine.memory()
        assert memory == OffloadStep(engine).memory()      # the trainer's handle shows it
        assert memory["device_peak_bytes"] == engine.device_peak_bytes == \
            engine.device.peak_bytes <= memory["device_budget_bytes"]
        if tier == "disk":
            assert memory["disk_bytes"] == dir_bytes(str(tmp_path)) > 0
            assert memory["disk_read_bytes"] == engine.store.disk.io.bytes_read > 0
            assert memory["disk_written_bytes"] == engine.store.disk.io.bytes_written > 0
        else:
            assert set(memory) == {"device_peak_bytes", "device_budget_bytes"}
    finally:
        engine.close()


def test_host_tier_has_every_method_of_the_disk_tier_that_the_store_calls():
    store_src = inspect.getsource(__import__("moescale.offload.store",
                                             fromlist=["ExpertStore"]).ExpertStore)
    called = {name for name in dir(DiskTier) if not name.startswith("_")
              and f"self.tier.{name}" in store_src}
    assert {"record", "release", "announce", "skip", "flush", "set_slot_rows", "geometry",
            "host_bytes", "memory", "close", "add_experts", "reserve"} <= called
    missing = sorted(name for name in called if not hasattr(HostTier, name))
    assert not missing, f"HostTier lacks {missing}"
