"""Consolidated safetensors checkpoints: round trip, tied weights, rank-count independence,
expert-shard loading, atomic writes and clear errors (real files under tmp_path)."""

import json
import os
import struct

import pytest
import torch
from torch import nn

from moescale.layers.experts import GroupedExperts
from moescale.models import GPT, GPTConfig, OffloadedExpertsWarning
from moescale.models.checkpoint import (expert_keys, load_checkpoint, merge_expert_shards,
                                        read_checkpoint, save_checkpoint, slice_experts)


def micro(**kw):
    fields = dict(vocab_size=32, seq_len=8, n_layers=2, d_model=16, n_heads=2, d_ff=24,
                  num_experts=4, top_k=2)
    return GPTConfig.from_flat(**{**fields, **kw})


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def data_bytes(path):
    raw = path.read_bytes()
    return raw[8 + struct.unpack("<Q", raw[:8])[0]:]


def test_round_trip_tied_weights_and_metadata(tmp_path):
    torch.manual_seed(0)
    model = GPT(micro(glu=True, activation="silu"))
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, metadata={"step": 7, "config": {"d_model": 16}})
    meta = header(path)["__metadata__"]
    assert meta["format"] == "moescale-consolidated" and meta["version"] == "1"
    assert "lm_head.weight" in json.loads(meta["aliases"])      # tied: stored once
    assert sorted(json.loads(meta["expert_keys"])) == sorted(expert_keys(model))
    assert len(expert_keys(model)) == 2 * 3                      # w1, w2, w3 per MoE layer
    assert os.listdir(tmp_path) == ["model.safetensors"]         # no temp file left

    torch.manual_seed(1)
    other = GPT(micro(glu=True, activation="silu"))
    user = load_checkpoint(path, other)
    assert user == {"step": 7, "config": {"d_model": 16}}
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    assert other.lm_head.weight is other.tok_emb.weight
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(other(ids)[0], model(ids)[0], atol=0, rtol=0)


def test_file_is_independent_of_the_number_of_ranks(tmp_path):
    torch.manual_seed(0)
    full = GPT(micro()).state_dict()
    save_checkpoint(tmp_path / "one.safetensors", full)
    for owners in ([[0, 1], [2, 3]], [[3], [1], [0], [2]]):
        shards = [slice_experts(full, ids) for ids in owners]
        assert shards[0]["blocks.0.ffn.experts.w1_EDF"].shape[0] == len(owners[0])
        merged = merge_expert_shards(shards, owners)
        for k, v in full.items():
            assert torch.equal(merged[k], v), k
        name = tmp_path / f"{len(owners)}.safetensors"
        save_checkpoint(name, merged)
        # same header (as JSON: safetensors orders metadata keys arbitrarily) and same data bytes
        assert header(name) == header(tmp_path / "one.safetensors")
        assert data_bytes(name) == data_bytes(tmp_path / "one.safetensors")


def test_load_an_expert_shard(tmp_path):
    torch.manual_seed(0)
    src, dst = nn.Module(), nn.Module()
    src.experts = GroupedExperts(4, 8, 12, glu=True)
    dst.experts = GroupedExperts(2, 8, 12, glu=True)
    save_checkpoint(tmp_path / "c.safetensors", src)
    load_checkpoint(tmp_path / "c.safetensors", dst, expert_ids=[3, 1])
    assert torch.equal(dst.experts.w1_EDF, src.experts.w1_EDF[[3, 1]])
    assert torch.equal(dst.experts.w2_EFD[1], src.experts.w2_EFD[1])


def test_overwrite_is_atomic_and_errors_are_clear(tmp_path):
    path = tmp_path / "c.safetensors"
    model = GPT(micro())
    save_checkpoint(path, model, metadata={"step": 1})
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(path, model, metadata={"bad": object()})
    assert read_checkpoint(path)[1] == {"step": 1}               # old file intact
    save_checkpoint(path, model, metadata={"step": 2})
    assert read_checkpoint(path)[1] == {"step": 2}
    assert os.listdir(tmp_path) == ["c.safetensors"]

    with pytest.raises(ValueError, match="shapes differ"):
        load_checkpoint(path, GPT(micro(d_ff=32)))
    with pytest.raises(ValueError, match="does not exist"):
        read_checkpoint(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not a moescale"):
        read_checkpoint(tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="cover"):
        merge_expert_shards([model.state_dict()] * 2, [[0, 1], [1, 2]])


def test_offloaded_experts_are_saved_from_the_store(tmp_path):
    from moescale.layers.moe import MoE
    from moescale.offload import OffloadConfig, offload_moe

    torch.manual_seed(0)
    model = GPT(micro(glu=True, activation="silu"))
    module_moe = MoE(8, 3, 2, experts=[nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
                                       for _ in range(3)])
    model.extra = module_moe   # a ModuleExperts layer too (per-expert names)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    engine = offload_moe(model, OffloadConfig(device_budget_experts=2))
    try:
        with pytest.warns(OffloadedExpertsWarning):       # experts are gone, and it says so
            assert not any(k.endswith("w1_EDF") for k in model.state_dict())
        save_checkpoint(tmp_path / "c.safetensors", model)
        with pytest.raises(ValueError, match="before offload_moe"):
            load_checkpoint(tmp_path / "c.safetensors", model)
    finally:
        engine.close()
    state, _ = read_checkpoint(tmp_path / "c.safetensors")
    assert state.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(state[k], v), k
