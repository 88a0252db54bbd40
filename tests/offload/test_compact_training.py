"""Training with compact expert state (bf16 master, bf16 / int8 moments) end to end: the host
and disk tiers give bitwise the same losses for one format, every format tracks fp32 state, a
run resumed from expert shards or from a store checkpoint continues bitwise, and checkpoints
load across formats (fp32 state into a compact store and back)."""

import copy

import pytest
import torch

import moescale
from moescale.expert_state import load_expert_shards, save_expert_shards
from moescale.models.resident import dense_state_dict
from moescale.offload import OffloadConfig, offload_moe

FORMATS = [("bf16", "int8"), ("fp32", "int8"), ("bf16", "bf16"), ("fp32", "bf16")]


def build(tmp_path, tier, master, moments, name="store"):
    torch.manual_seed(0)
    cfg = moescale.gpt_config("tiny", n_layers=2, d_model=64, n_heads=2, d_ff=128)
    model = moescale.GPT(cfg)
    directory = None
    if tier == "disk":
        directory = tmp_path / f"{name}-{master}-{moments}"
        directory.mkdir(exist_ok=True)
    engine = offload_moe(model, OffloadConfig(
        tier=tier, directory=None if directory is None else str(directory),
        host_cache_bytes=(1 << 20) if tier == "disk" else None, device_budget_experts=3,
        step_mode="eager", master=master, moments=moments, seed=5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine.follow(opt)
    return model, opt, engine


def train(model, opt, engine, steps, first=0):
    out = []
    for step in range(first, first + steps):
        batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))
        engine.begin_micro_batch(last=True)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        engine.step()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("master,moments", FORMATS[:1])
def test_host_and_disk_tiers_train_bitwise_alike(tmp_path, master, moments):
    runs = []
    for tier in ("host", "disk"):
        model, opt, engine = build(tmp_path, tier, master, moments)
        runs.append(train(model, opt, engine, 5))
        engine.close()
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_every_format_tracks_fp32_state(tmp_path):
    model, opt, engine = build(tmp_path, "host", "fp32", "fp32")
    exact = train(model, opt, engine, 8)
    engine.close()
    for master, moments in FORMATS:
        model, opt, engine = build(tmp_path, "host", master, moments)
        got = train(model, opt, engine, 8)
        engine.close()
        assert all(abs(a - b) / b < 5e-3 for a, b in zip(got, exact)), (master, moments, got)
        assert got != exact        # it is another format (the first step's forward aside)


def resumed_bitwise(tmp_path, tier, save, load) -> bool:
    """Train 3 steps, save(model, opt, engine), train 3 more; a fresh build given the dense
    state and load(model, opt, engine, saved) trains those 3 with the same losses?"""
    model, opt, engine = build(tmp_path, tier, "bf16", "int8")
    train(model, opt, engine, 3)
    saved = save(model, opt, engine)
    dense = {k: v.clone() for k, v in dense_state_dict(model).items()}
    dense_opt = copy.deepcopy(opt.state_dict())
    rest = train(model, opt, engine, 3, first=3)
    engine.close()
    model, opt, engine = build(tmp_path, tier, "bf16", "int8", name="resumed")
    model.load_state_dict(dense, strict=False)
    opt.load_state_dict(dense_opt)
    load(model, opt, engine, saved)
    again = train(model, opt, engine, 3, first=3)
    engine.close()
    return again == rest


@pytest.mark.parametrize("tier", [pytest.param("host", marks=pytest.mark.slow), "disk"])
def test_expert_shards_resume_bitwise(tmp_path, tier):
    def save(model, opt, engine):
        return save_expert_shards(model, str(tmp_path), rank=0, tag="00000003", optimizer=opt,
                                  engine=engine)

    def load(model, opt, engine, entry):
        counts = load_expert_shards(model, str(tmp_path), [entry], optimizer=opt, engine=engine)
        assert counts["adopted"] == (counts["experts"] if tier == "disk" else 0)
    assert resumed_bitwise(tmp_path, tier, save, load)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_store_checkpoint_resumes_bitwise(tmp_path, tier):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert resumed_bitwise(
        tmp_path, tier, lambda m, o, engine: engine.save_checkpoint(str(ckpt), tag="00000003"),
        lambda m, o, engine, _: engine.load_checkpoint(str(ckpt), tag="00000003"))


def test_checkpoints_load_across_formats(tmp_path):
    """fp32 expert shards into a compact disk store (masters rounded to bf16, moments
    quantised), and that store's shards into an fp32 host store (decoded exactly)."""
    model, opt, engine = build(tmp_path, "host", "fp32", "fp32")
    train(model, opt, engine, 2)
    exact = (tmp_path / "exact")
    exact.mkdir()
    entry = save_expert_shards(model, str(exact), rank=0, tag="2", optimizer=opt, engine=engine)
    want = engine.store.get_state((0, 3))
    engine.close()
    model, opt, engine = build(tmp_path, "disk", "bf16", "int8")
    counts = load_expert_shards(model, str(exact), [entry], optimizer=opt, engine=engine)
    assert counts["adopted"] == 0           # another format: decoded, then encoded
    master, m, v = engine.store.get_state((0, 3))
    assert torch.equal(master, want[0].to(torch.bfloat16).float())
    assert float((m - want[1]).abs().max()) <= 0.02 * float(want[1].abs().max())
    compact = tmp_path / "compact"
    compact.mkdir()
    entry = save_expert_shards(model, str(compact), rank=0, tag="2", optimizer=opt,
                               engine=engine)
    engine.close()
    model, opt, engine = build(tmp_path, "host", "fp32", "fp32", name="back")
    load_expert_shards(model, str(compact), [entry], optimizer=opt, engine=engine)
    back = engine.store.get_state((0, 3))
    assert all(torch.equal(a, b) for a, b in zip(back, (master, m, v)))
    engine.close()


def test_host_tier_holds_the_formats_bytes_between_steps(tmp_path):
    """Experts per GiB of host memory: a compact host store holds master and moments in its
    format and a gradient only from an expert's backward to its (eager) step."""
    held = {}
    for master, moments in (("fp32", "fp32"), ("bf16", "int8"), ("fp32", "int8")):
        model, opt, engine = build(tmp_path, "host", master, moments)
        train(model, opt, engine, 2)
        engine.synchronize()
        held[master, moments] = engine.store.host_bytes()
        params = sum(engine.store.layouts[lay].numel * n
                     for lay, n in enumerate(engine.store.num_experts))
        assert not engine.store.host_grads.live           # every expert stepped: no gradient kept
        engine.close()
        assert held[master, moments] <= params * (16 if master == "fp32" == moments else
                                                  engine.config.state.state_bytes_per_param()
                                                  + 0.01)
    assert held["fp32", "fp32"] / held["bf16", "int8"] >= 3.9
    assert held["fp32", "fp32"] / held["fp32", "int8"] >= 2.6
