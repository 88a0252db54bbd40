"""Sharded expert checkpoints in one process: every pair of residencies (resident with the
torch optimizer's AdamW state, host store, disk store) saves and loads exactly; the shard file
is an ordinary safetensors file; a disk-tier save links the store's files and a disk-tier load
adopts them; a damaged, missing or foreign shard raises ShardCheckpointError (a
StoreCheckpointError) and changes nothing; bad arguments are ValueErrors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from moescale.expert_state import (ShardCheckpointError, expert_parameters, expert_state_keys,
                                   load_expert_shards, save_expert_shards)
from moescale.models.gpt import GPT, GPTConfig
from moescale.offload.checkpoint import StoreCheckpointError

from shard_workers import build, snapshot, train_step


def _trained(tier, tmp_path, name="src", steps=2):
    model, opt, engine, _ = build(0, 1, tier, str(tmp_path / f"store-{name}"))
    for step in range(steps):
        train_step(model, opt, engine, None, step, 0, 1)
    return model, opt, engine


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, d in got.items():
        assert set(d) == set(want[key]), (key, sorted(d), sorted(want[key]))
        for name, t in d.items():
            assert t == want[key][name] if name == "step" else torch.equal(t, want[key][name]), \
                (key, name)


@pytest.mark.parametrize("src,dst", [(None, None), (None, "host"), ("host", None),
                                     ("disk", None), (None, "disk"), ("host", "disk"),
                                     ("disk", "disk")])
def test_any_residency_loads_any_other_exactly(src, dst, tmp_path):
    model, opt, engine = _trained(src, tmp_path)
    want = snapshot(model, opt, engine)
    entry = save_expert_shards(model, str(tmp_path), rank=0, tag="00000002", optimizer=opt,
                               engine=engine)
    assert entry["experts"] == {"blocks.0.ffn.experts": [[0, 4]],
                                "blocks.1.ffn.experts": [[0, 4]]}
    target, topt, tengine, _ = build(0, 1, dst, str(tmp_path / "store-dst"), seed=3)
    try:
        result = load_expert_shards(target, str(tmp_path), [entry], optimizer=topt,
                                    engine=tengine)
        _assert_same(snapshot(target, topt, tengine), want)
        assert result["experts"] == 8
        assert result["adopted"] == (8 if (src, dst) == ("disk", "disk") else 0)
        if (src, dst) == ("disk", "disk"):    # adopted: the store's file is the shard's
            shard = tmp_path / entry["path"]
            assert os.path.samefile(tengine.store.path((1, 3)),
                                    shard / "layer001" / "expert00003.bin")
    finally:
        for eng in (engine, tengine):
            if eng is not None:
                eng.close()


def test_shard_file_is_plain_safetensors_with_global_names(tmp_path):
    model, opt, _ = _trained(None, tmp_path)
    entry = save_expert_shards(model, str(tmp_path), rank=3, tag="t", optimizer=opt)
    assert entry["path"] == "expert-shards-t/rank00003"
    path = tmp_path / entry["path"] / "experts.safetensors"
    w2 = model.blocks[1].ffn.experts.w2_EFD
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("blocks.1.ffn.experts/2/master/w2_EFD"), w2[2])
        assert torch.equal(f.get_tensor("blocks.1.ffn.experts/2/exp_avg_sq/w2_EFD"),
                           opt.state[w2]["exp_avg_sq"][2])
    index = json.loads((tmp_path / entry["path"] / "index.json").read_text())
    assert index["layers"]["blocks.1.ffn.experts"]["experts"]["2"]["step"] == 2.0


def test_weights_only_without_optimizer_state(tmp_path):
    model, opt, _ = _trained(None, tmp_path, steps=0)      # never stepped: no AdamW state
    entry = save_expert_shards(model, str(tmp_path), rank=0, tag="t", optimizer=opt)
    target, topt, engine, _ = build(0, 1, "host", str(tmp_path / "h"), seed=3)
    try:
        load_expert_shards(target, str(tmp_path), [entry], engine=engine)
        got = snapshot(target, topt, engine)
        assert got[("blocks.0.ffn.experts", 1)]["step"] == 0.0
        assert not got[("blocks.0.ffn.experts", 1)]["exp_avg/w1_EDF"].any()
    finally:
        engine.close()
    trained, topt2, _ = _trained(None, tmp_path, steps=1)
    load_expert_shards(trained, str(tmp_path), [entry], optimizer=topt2)
    assert all(p not in topt2.state for p in expert_parameters(trained))   # state dropped


def _corrupt_tensor_file(tmp_path, entry):
    path = tmp_path / entry["path"] / "experts.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def _corrupt_record(tmp_path, entry):
    path = tmp_path / entry["path"] / "layer001" / "expert00002.bin"
    with open(path, "r+b") as f:
        f.seek(4100)     # the moment row's first chunk
        byte = f.read(1)
        f.seek(4100)
        f.write(bytes([byte[0] ^ 1]))


CORRUPTIONS = {
    "flipped tensor bit": (None, _corrupt_tensor_file),
    "truncated tensor file": (None, lambda d, e: os.truncate(
        d / e["path"] / "experts.safetensors", 2000)),
    "flipped record bit": ("disk", _corrupt_record),
    "missing record": ("disk", lambda d, e: os.unlink(
        d / e["path"] / "layer000" / "expert00001.bin")),
    "edited index": (None, lambda d, e: (d / e["path"] / "index.json").write_text(
        (d / e["path"] / "index.json").read_text().replace('"step":2.0', '"step":5.0'))),
    "missing shard": (None, lambda d, e: os.rename(d / e["path"], d / (e["path"] + ".gone"))),
}


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_corrupt_shard_is_refused_and_changes_nothing(what, tmp_path):
    tier, corrupt = CORRUPTIONS[what]
    model, opt, engine = _trained(tier, tmp_path)
    entry = save_expert_shards(model, str(tmp_path), rank=0, tag="t", optimizer=opt,
                               engine=engine)
    if engine is not None:
        engine.close()
    corrupt(tmp_path, entry)
    target, topt, _, _ = build(0, 1, None, "", seed=3)
    train_step(target, topt, None, None, 0, 0, 1)
    before = snapshot(target, topt, None)
    with pytest.raises(ShardCheckpointError) as err:
        load_expert_shards(target, str(tmp_path), [entry], optimizer=topt)
    assert isinstance(err.value, StoreCheckpointError)
    assert "corrupt" in str(err.value) or "incomplete" in str(err.value)
    _assert_same(snapshot(target, topt, None), before)


def test_foreign_or_incomplete_manifests_are_refused(tmp_path):
    model, opt, _ = _trained(None, tmp_path)
    entry = save_expert_shards(model, str(tmp_path), rank=0, tag="t", optimizer=opt)
    torch.manual_seed(0)
    other = GPT(GPTConfig.from_flat(vocab_size=48, seq_len=8, n_layers=2, d_model=16, n_heads=2,
                                    d_ff=24, num_experts=4, top_k=2))
    with pytest.raises(ShardCheckpointError, match="build the same model"):
        load_expert_shards(other, str(tmp_path), [entry])
    partial = dict(entry, experts={k: [[0, 2]] for k in entry["experts"]})
    with pytest.raises(ShardCheckpointError, match="no shard of the checkpoint holds expert 2"):
        load_expert_shards(model, str(tmp_path), [partial])
    with pytest.raises(ShardCheckpointError, match="is in two shards"):
        load_expert_shards(model, str(tmp_path), [entry, dict(entry)])
    with pytest.raises(ShardCheckpointError, match="sha256"):
        load_expert_shards(model, str(tmp_path), [dict(entry, index_sha256="0" * 64)])
    with pytest.raises(ShardCheckpointError, match="not an expert-shard entry"):
        load_expert_shards(model, str(tmp_path), [dict(entry, path="../../etc")])


def test_same_tag_twice_never_overwrites_a_shard(tmp_path):
    model, opt, _ = _trained(None, tmp_path)
    first = save_expert_shards(model, str(tmp_path), rank=0, tag="t", optimizer=opt)
    train_step(model, opt, None, None, 5, 0, 1)
    second = save_expert_shards(model, str(tmp_path), rank=0, tag="t", optimizer=opt)
    assert (first["path"], second["path"]) == ("expert-shards-t/rank00000",
                                               "expert-shards-t/rank00000.1")
    target, topt, _, _ = build(0, 1, None, "", seed=3)
    load_expert_shards(target, str(tmp_path), [first], optimizer=topt)   # still verifies
    assert not list(tmp_path.glob("expert-shards-t/*.tmp"))


def test_dense_keys_and_bad_arguments(tmp_path):
    model, opt, _ = _trained(None, tmp_path, steps=0)
    keys = expert_state_keys(model)
    assert keys == {k for k in model.state_dict() if ".experts." in k} and len(keys) == 4
    assert {id(p) for p in expert_parameters(model)} == \
        {id(p) for n, p in model.named_parameters() if ".experts." in n}
    for kwargs, match in [(dict(tag="a/b"), "tag="), (dict(tag="t", rank=-1), "rank="),
                          (dict(tag="t", share=(2, 2)), "share=")]:
        kwargs = dict(dict(rank=0), **kwargs)
        with pytest.raises(ValueError, match=match):
            save_expert_shards(model, str(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="does not exist"):
        save_expert_shards(model, str(tmp_path / "nope"), rank=0, tag="t")
