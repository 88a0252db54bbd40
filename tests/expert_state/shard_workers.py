"""Rank functions for the expert-shard tests: train a tiny MoE GPT (single process, or static
expert parallelism over the ranks; experts resident, or offloaded to a host or disk store),
save sharded, and load at another rank count into any residency.

`snapshot(model, optimizer, engine)` reads every held expert's state straight from its
container (parameters and the torch optimizer's state, or the store's records), keyed by
(layer key, GLOBAL expert): the consolidated view the comparisons use. `train_and_save` also
checks its gathered snapshot against `full_state_dict` (the consolidated checkpoint path).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from moescale.expert_state import (expert_parameters, expert_state_keys, load_expert_shards,
                                   save_expert_shards)
from moescale.layers.experts import GroupedExperts
from moescale.layers.moe import MoE
from moescale.models.gpt import GPT, GPTConfig
from moescale.offload import OffloadConfig, offload_moe
from moescale.shared_store.experts import (SharedStoreExperts, dynamic_placement_moe,
                                               step_shared_experts)
from moescale.parallel.expert_parallel import ExpertShard, expert_parallel_model
from moescale.parallel.grad_sync import allreduce_gradients
from moescale.parallel.groups import ParallelConfig, build_groups
from moescale.shared_store.node_store import node_expert_store
from moescale.parallel.placement import PlacementConfig
from moescale.parallel.state import full_state_dict

VOCAB, SEQ, ROWS = 48, 8, 2
NAMES = ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED")
ROW_OF = {"master": 0, "exp_avg": 2, "exp_avg_sq": 3}   # the store's logical rows


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_flat(vocab_size=VOCAB, seq_len=SEQ, n_layers=2, d_model=16,
                                   n_heads=2, d_ff=32, num_experts=4, top_k=2, init_std=0.1))


def build(rank: int, world: int, tier: str | None, store_dir: str, seed: int = 0):
    """(model, optimizer, engine, groups) on this rank: EP over the world when world > 1;
    tier "dynamic": dynamic placement over one node store shared by the ranks."""
    model, groups = make_model(seed), None
    if tier == "dynamic":
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        store = node_expert_store(moes, None)         # /dev/shm, removed once mapped
        index = {id(m): i for i, m in enumerate(moes)}
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if id(child) in index:
                    setattr(module, name, dynamic_placement_moe(
                        child, store, index[id(child)], None, PlacementConfig(
                            num_devices=world)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05), \
            None, None
    if world > 1:
        groups = build_groups(ParallelConfig(backend="gloo", timeout_s=20))
        expert_parallel_model(model, groups)
    engine = None
    if tier is not None:
        os.makedirs(store_dir, exist_ok=True)
        engine = offload_moe(model, OffloadConfig(
            tier=tier, directory=store_dir if tier == "disk" else None,
            device_budget_experts=2, host_cache_bytes=1 << 20 if tier == "disk" else None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    if engine is not None:
        engine.follow(opt)
    return model, opt, engine, groups


def train_step(model, opt, engine, groups, step: int, rank: int, world: int) -> float:
    """One AdamW step on this rank's rows of the step's batch; the mean loss over ranks."""
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    tgt = torch.roll(idx, -1, dims=1)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    _, loss = model(idx[rows], tgt[rows])
    loss.backward()
    shared = [m.experts for m in model.modules()
              if isinstance(m, MoE) and isinstance(m.experts, SharedStoreExperts)]
    if groups is not None:
        allreduce_gradients(model, groups)
    elif shared:           # dynamic placement: dense gradients averaged, owners step experts
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        step_shared_experts(shared, None, lr=1e-2, weight_decay=0.05)
    if engine is not None:
        engine.step()
    opt.step()
    opt.zero_grad()
    value = torch.tensor([loss.item()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(value)
    return float(value[0]) / world


def snapshot(model, opt, engine) -> dict:
    """{(layer key, global e): {"<part>/<name>": tensor, "step": float}} of the held experts."""
    out = {}
    if engine is not None:
        engine.synchronize()      # queued expert steps first
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        key, experts, start = f"{name}.experts", moe.experts, 0
        if isinstance(experts, ExpertShard):
            experts, start = experts.local, experts.expert_ids.start
        if isinstance(experts, GroupedExperts):
            for pname in NAMES:
                p = getattr(experts, pname)
                if p is None:
                    continue
                state = opt.state.get(p) or {}
                for l in range(experts.num_experts):
                    d = out.setdefault((key, start + l), {})
                    d[f"master/{pname}"] = p.detach()[l].clone()
                    if state:
                        d[f"exp_avg/{pname}"] = state["exp_avg"][l].clone()
                        d[f"exp_avg_sq/{pname}"] = state["exp_avg_sq"][l].clone()
                        d["step"] = float(state["step"])
            continue
        store = experts.store if isinstance(experts, SharedStoreExperts) else engine.store
        layout = store.layouts[experts.layer_index]
        for l in range(experts.num_experts):
            record, step = store.read_record((experts.layer_index, l))
            d = out.setdefault((key, start + l), {"step": step})
            for part, row in ROW_OF.items():
                for pname, t in layout.split(record[row]).items():
                    d[f"{part}/{pname}"] = t.clone()
    return out


def _dense(model, opt) -> dict:
    skip = expert_state_keys(model)
    experts = {id(p) for p in expert_parameters(model)}
    return dict(model={k: v.clone() for k, v in model.state_dict().items() if k not in skip},
                optim={n: copy.deepcopy(opt.state[p]) for n, p in model.named_parameters()
                       if id(p) not in experts and p in opt.state})


def train_and_save(rank: int, world: int, tier, directory: str, steps: int):
    """Train `steps` steps, save the dense half (rank 0) and the expert shards, train one more
    step; returns (this rank's entry, the loss of the step after the save). Rank 0 writes the
    consolidated snapshot (ref.pt) the loads compare with."""
    model, opt, engine, groups = build(rank, world, tier, f"{directory}/store-w{world}-r{rank}")
    try:
        for step in range(steps):
            train_step(model, opt, engine, groups, step, rank, world)
        mine = snapshot(model, opt, engine)
        parts = [mine] if world == 1 else [None] * world
        if world > 1:
            dist.all_gather_object(parts, mine)
        ref = {k: v for part in parts for k, v in part.items()}
        if tier is None and groups is not None:      # the consolidated checkpoint's weights
            full = full_state_dict(model, groups)
            for (key, e), d in ref.items():
                for pname in NAMES:
                    if f"master/{pname}" in d:
                        assert torch.equal(full[f"{key}.{pname}"][e], d[f"master/{pname}"])
        entry = save_expert_shards(model, directory, rank=rank, tag=f"{steps:08d}",
                                   optimizer=opt, engine=engine,
                                   share=(rank, world) if tier == "dynamic" else None)
        if tier == "disk":     # the shard's record files are the store's own (hard links)
            store = engine.store
            for layer, num in enumerate(store.num_experts):
                for l in range(num):
                    linked = os.path.join(directory, entry["path"], f"layer{layer:03d}",
                                          f"expert{rank * num + l:05d}.bin")
                    assert os.path.samefile(linked, store.path((layer, l))), linked
        if rank == 0:
            torch.save(dict(experts=ref, dense=_dense(model, opt)), f"{directory}/ref.pt")
        after = train_step(model, opt, engine, groups, steps, rank, world)
        return entry, after
    finally:
        if engine is not None:
            engine.close()


def load_and_check(rank: int, world: int, tiers, directory: str, entries, steps: int):
    """For each target residency in `tiers`: a fresh model (other seed) on this rank, the dense
    half and the expert shards loaded; its held experts must equal the reference exactly, and
    the next step's loss is returned (one per tier)."""
    ref = torch.load(f"{directory}/ref.pt", weights_only=False)
    losses = []
    for i, tier in enumerate(tiers):
        model, opt, engine, groups = build(rank, world, tier,
                                           f"{directory}/load{i}-w{world}-r{rank}", seed=7)
        try:
            model.load_state_dict(ref["dense"]["model"], strict=False)
            for n, p in model.named_parameters():
                if n in ref["dense"]["optim"]:
                    opt.state[p] = copy.deepcopy(ref["dense"]["optim"][n])
            share = (rank, world) if tier == "dynamic" else None
            load_expert_shards(model, directory, entries, optimizer=opt, engine=engine,
                               share=share)
            if share is not None:
                dist.barrier()            # every block written before anyone reads
            got = snapshot(model, opt, engine)
            assert got, "nothing held"
            for k, d in got.items():
                want = ref["experts"][k]
                assert set(d) == set(want), (k, sorted(d), sorted(want))
                for name, t in d.items():
                    ok = t == want[name] if name == "step" else torch.equal(t, want[name])
                    assert ok, (tier, k, name)
            losses.append(train_step(model, opt, engine, groups, steps, rank, world))
        finally:
            if engine is not None:
                engine.close()
        if world > 1:
            dist.barrier()
    return losses
