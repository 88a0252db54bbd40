"""Rank bodies for the dynamic-placement tests (run under moescale.parallel.launch.run_local).

The parent builds, per case, the full single-process MoE from a fixed seed and a host
ExpertStore in shared memory holding its experts; every rank rebuilds the same MoE and inputs,
computes the single-process reference for the whole world (ep_workers' helpers), attaches to
the shared store, runs its own tokens through a dynamic-placement layer and checks its output,
its input gradient, the averaged router gradient and the store's accumulated expert gradients
(summed over split shards by the owners) against the reference. The same case also runs with
replicated GroupedExperts and `sum_expert_grads`. Loss convention as in ep_workers.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from moescale.layers.moe import MoE
from moescale.offload.store import ExpertStore, StoreConfig
from moescale.parallel.dynamic import (DynamicPlacementDispatcher, placement_stats,
                                       random_placement_hook, sum_expert_grads)
from moescale.shared_store.experts import (PARAM_NAMES, dynamic_placement_moe,
                                               shared_expert_store)
from moescale.parallel.placement import PlacementConfig

from ep_workers import _close, _full_moe, _inputs, _reference


def build_store(case: dict):
    """(shared state, layouts) of a store holding the case's experts (in the parent)."""
    store = shared_expert_store([_full_moe(case)])
    return store.shared_state(), store.layouts


def _hook(case, world):
    return random_placement_hook(case["seed"], world) if case.get("random") else None


def _router_grad_mean(moe: MoE, world: int) -> torch.Tensor:
    g = moe.router.weight.grad.clone()
    dist.all_reduce(g)
    return g / world


def _check_outputs(case, moe, x, y, cs, y_ref, gx_ref, full, world, rank):
    _close("output", y.detach(), y_ref[rank], case)
    total = max(sum(c.shape[0] for c in cs), 1)
    loss = world * (y * cs[rank]).sum() / total + moe.last_aux_loss
    loss.backward()
    _close("input grad", x.grad / world, gx_ref[rank], case)
    _close("router grad", _router_grad_mean(moe, world), full.router.weight.grad, case)


def check_dynamic(rank: int, world: int, cases: list[dict], stores: list) -> list:
    """Each case: shared-store experts, then replicated experts; returns per case the
    number of split experts and the max/mean modelled load the dispatcher reported."""
    out = []
    for case, (state, layouts) in zip(cases, stores):
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, world)
        config = PlacementConfig(num_devices=world, split=case.get("split", False),
                                 upload_cost=5.0 if case.get("affinity") else 0.0)
        options = dict(placement_hook=_hook(case, world))
        if case.get("affinity"):   # device d caches experts d and d + W (same on every rank)
            options["resident"] = lambda: [{d, d + world} for d in range(world)]
        # 1. experts in the shared host store
        store = ExpertStore.attach(StoreConfig(tier="host", shared_memory=True), layouts, state)
        moe = dynamic_placement_moe(full, store, 0, None, config, **options)
        x = xs[rank].clone().requires_grad_(True)
        y = moe(x)
        stats = moe.dispatcher.stats
        _check_outputs(case, moe, x, y, cs, y_ref, gx_ref, full, world, rank)
        dist.barrier()   # every owner has accumulated
        acc_EP = moe.experts.grad_rows()
        for e in range(case["E"]):
            got = moe.experts.layout.split(acc_EP[e])
            for name in moe.experts.layout.names:
                want = getattr(full.experts, name).grad
                want = torch.zeros_like(got[name]) if want is None else want[e]
                _close(f"store grad {name}[{e}]", got[name], want, case)
        # 2. replicated parameter experts, partial gradients summed
        experts = copy.deepcopy(full.experts)
        experts.zero_grad(set_to_none=True)
        rep = MoE(config=full.config, experts=experts,
                  dispatcher=DynamicPlacementDispatcher(None, case["E"], config, **options))
        rep.router.load_state_dict(full.router.state_dict())
        x2 = xs[rank].clone().requires_grad_(True)
        _check_outputs(case, rep, x2, rep(x2), cs, y_ref, gx_ref, full, world, rank)
        sum_expert_grads(experts, None)
        for name in PARAM_NAMES:
            p = getattr(experts, name)
            if p is not None:
                _close(f"replicated grad {name}", p.grad, getattr(full.experts, name).grad,
                       case)
        out.append((case["name"], stats.num_split, stats.imbalance))
    return out


def _tiny_gpt():
    from moescale.models import gpt_config
    from moescale.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_layers=2, d_model=32, n_heads=2, d_ff=64, seq_len=32))


def gpt_store():
    """(shared state, layouts) of the tiny GPT's experts (in the parent)."""
    store = shared_expert_store([m for m in _tiny_gpt().modules() if isinstance(m, MoE)])
    return store.shared_state(), store.layouts


def train_dynamic(rank: int, world: int, steps: int, state, layouts, placement: str) -> list:
    """The tiny GPT trained with dynamic placement over a shared store on W ranks (AdamW for
    dense and experts) and, on every rank, single-process offloaded training of the full
    batch: the losses (ranks' mean) agree step by step and the final expert masters match."""
    from moescale.offload import OffloadConfig, offload_moe
    from moescale.shared_store.experts import step_shared_experts

    single = _tiny_gpt()
    dyn = copy.deepcopy(single)
    engine = offload_moe(single, OffloadConfig(tier="host", device="cpu"))
    store = ExpertStore.attach(StoreConfig(tier="host", shared_memory=True), layouts, state)
    index = 0
    for module in list(dyn.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, MoE):
                hook = random_placement_hook(index, world) if placement == "random" else None
                setattr(module, name, dynamic_placement_moe(
                    child, store, index, None, PlacementConfig(num_devices=world, split=True),
                    placement_hook=hook))
                index += 1
    layers = [m.experts for m in dyn.modules() if isinstance(m, MoE)]
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opts = [torch.optim.AdamW(m.parameters(), **hp) for m in (single, dyn)]
    engine.follow(opts[0])
    gen = torch.Generator().manual_seed(7)
    batch, seq = 2 * world, 32
    losses, imbalance, num_split = [], [], 0
    for _ in range(steps):
        data = torch.randint(0, 256, (batch, seq + 1), generator=gen)
        idx, tgt = data[:, :-1], data[:, 1:]
        engine.begin_micro_batch(last=True)
        _, loss_single = single(idx, tgt)
        loss_single.backward()
        engine.step()
        opts[0].step()
        opts[0].zero_grad()
        mine = slice(rank * batch // world, (rank + 1) * batch // world)
        _, loss_dyn = dyn(idx[mine], tgt[mine])
        loss_dyn.backward()
        for p in dyn.parameters():    # dense (replicated) gradients: mean over ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        step_shared_experts(layers, None, **hp)
        opts[1].step()
        opts[1].zero_grad()
        mean_loss = loss_dyn.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append((loss_single.item(), mean_loss.item() / world))
        logged = placement_stats(dyn)
        imbalance.append(logged["placement_max_over_mean"])
        num_split += int(logged["placement_split_experts"])
    engine.synchronize()
    master_err = 0.0   # after 20 Adam steps: fp32 rounding amplified where gradients ~ 0
    for layer in layers:
        for e in range(layer.num_experts):
            want = engine.expert_state(layer.layer_index, e)
            for name, got in layer.master_state(e).items():
                master_err = max(master_err, (got - want[name]).abs().max().item())
    engine.close()
    return losses, imbalance, num_split, master_err


def check_streamed(rank: int, world: int, cases: list[dict], stores: list, root: str) -> list:
    """Each case with the node's store streamed through a small per-rank device budget
    (StreamedSharedExperts): over the shared host store, then over a disk-tier copy of it in
    `root`/<case>. Output, input and router gradients, and every expert's accumulated
    gradient (read from the disk files after a fence) against the reference; the device peak
    stays within its budget. Returns per case the split experts and the device peaks."""
    import os

    from moescale.shared_store.streamed import RankDevice, StreamedSharedExperts
    from moescale.shared_store.node_disk import DiskCoherence, node_disk_store
    from moescale.offload.direct_io import align_up
    from moescale.offload.records import G

    out = []
    for k, (case, (state, layouts)) in enumerate(zip(cases, stores)):
        full = _full_moe(case)
        xs, cs = _inputs(case, world)
        y_ref, gx_ref, _ = _reference(case, full, xs, cs, world)
        config = PlacementConfig(num_devices=world, split=case.get("split", False))
        host = ExpertStore.attach(StoreConfig(tier="host", shared_memory=True), layouts, state)
        disk = node_disk_store(host, None, os.path.join(root, f"case{k}"),
                               host_cache_bytes=2 * 4 * align_up(4 * layouts[0].numel))
        coherence = DiskCoherence(disk, None)     # before any write: it tracks the changes
        peaks, splits = [], []
        for store in (host, disk):
            moe = dynamic_placement_moe(full, host, 0, None, config,
                                        placement_hook=_hook(case, world))
            device = RankDevice(store, budget_experts=2.0,
                                lookahead=case.get("lookahead", 1))
            moe.experts = StreamedSharedExperts.replacing(moe.experts, store, device,
                                                          case.get("policy", "keep"))
            x = xs[rank].clone().requires_grad_(True)
            y = moe(x)
            splits.append(moe.dispatcher.stats.num_split)
            _check_outputs(case, moe, x, y, cs, y_ref, gx_ref, full, world, rank)
            if store is disk:
                coherence.fence()     # every owner's gradient in the files, one view
            else:
                dist.barrier()
            for e in range(case["E"]):
                rec = store.acquire((0, e), G)
                got = moe.experts.layout.split(rec.grad_P.clone())
                store.release((0, e))
                for name in moe.experts.layout.names:
                    want = getattr(full.experts, name).grad
                    want = torch.zeros_like(got[name]) if want is None else want[e]
                    _close(f"{store.config.tier} grad {name}[{e}]", got[name], want, case)
            peak = device.memory()
            assert peak["device_peak_bytes"] <= peak["device_budget_bytes"], peak
            peaks.append(peak["device_peak_bytes"])
            dist.barrier()
            if store is host:
                for e in range(rank, case["E"], world):   # zero for the next pass
                    host.acquire((0, e)).grad_P.zero_()
                dist.barrier()
        disk.close()
        out.append((case["name"], splits, peaks))
    return out
