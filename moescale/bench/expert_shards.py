"""`moescale bench expert-shards`: peak memory of sharded expert checkpoints on the disk tier.

Question: does saving and resuming a checkpoint of a disk-tier expert-parallel run keep every
process below its own share of the expert state (moescale.expert_state), where the consolidated
path gathered every expert into rank 0's RAM?

Set-up (every phase in fresh gloo processes, `run_local`): a stack of residual MoE layers built
on the meta device, split over 2 expert-parallel ranks, each rank's experts offloaded to its own
disk-tier store (`offload_moe(expert_init=...)` writes them straight to their files; host cache
`--host-cache-mib`), one eager training step so that every record holds real moments.
glibc is told to return freed blocks of 64 KiB or more at once (mallopt, the same as
MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536, also set in the environment), so
the resident set follows the live memory. Around each measured call VmHWM is reset
(/proc/self/clear_refs) and read after: `peak` is the process's whole resident set at its
highest during the call (torch, the store's slot pool and everything else included), `delta`
the peak minus the resident set just before.

Phases: `save` on 2 ranks (save_expert_shards: the records are hard-linked); then, in the same
processes, the consolidated path for contrast (what moescale/train/ep_offload_backend.py did
before the shards: every rank reads its records, `dist.gather` to rank 0, rank 0 writes one
store checkpoint with save_records); `load-1` (one process, all experts, a fresh disk store:
load_expert_shards verifies every record by direct I/O and adopts it by hard link) and
`load-2` (2 ranks, each its own experts).

Writes runs/bench/<time>/expert_shards_<hardware>.json (CPU model flags, the config, every
rank's figures per phase, and the check: peak < share for every rank of save and load).
Not here: correctness (tests/expert_state), the trainer's commit point.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from moescale import proc_stats
from moescale.bench import disk_probe
from moescale.bench.ep_memory_rank import release_freed_memory, rss_bytes
from moescale.bench.measure import hardware_tag, result_path, write_json

GIB, MIB = 1 << 30, 1 << 20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench expert-shards",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2,
                   help="MoE layers")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (all ranks)")
    p.add_argument("--d-model", type=int, default=1024,
                   help="model width")
    p.add_argument("--d-ff", type=int, default=2048,
                   help="expert hidden width")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank of the one step")
    p.add_argument("--host-cache-mib", type=int, default=256,
                   help="disk tier: host RAM caching expert records, MiB per rank")
    p.add_argument("--dir", default=None, help="work directory on the disk to measure "
                   "(default: the system's temporary directory; not a tmpfs for a real "
                   "measurement)")
    p.add_argument("--no-gather", action="store_true", help="skip the consolidated path")
    p.add_argument("--out", default=None,
                   help="JSON path (default: under runs/bench/; a path under "
                        "benchmarks/results updates the recorded result)")
    return p


def _model(args: dict, groups):
    from moescale.bench.offload import MoEStack
    from moescale.parallel.expert_parallel import expert_parallel_model

    torch.manual_seed(0)
    with torch.device("meta"):      # the experts never exist in RAM
        model = MoEStack(args["layers"], args["d_model"], args["d_ff"], args["experts"], 2)
    if groups is not None:
        expert_parallel_model(model, groups)
    return model


def _offload(model, args: dict, directory: str):
    from moescale.offload import OffloadConfig, offload_moe

    def init(layer, e, layout):
        gen = torch.Generator().manual_seed(1000 * layer + e)
        return (torch.rand(layout.numel, generator=gen) - 0.5) * (2 / args["d_model"] ** 0.5)

    os.makedirs(directory, exist_ok=True)
    engine = offload_moe(model, OffloadConfig(
        tier="disk", directory=directory, host_cache_bytes=args["host_cache_mib"] * MIB,
        device_budget_experts=2, step_mode="eager"), expert_init=init)
    model.to_empty(device="cpu")
    for moe in model.moes:
        torch.nn.init.normal_(moe.router.weight, std=0.02)
    for norm in model.norms:
        norm.reset_parameters()
    return engine


def _measured(fn):
    """(fn's value, seconds, resident set before, peak during) of one call."""
    import gc

    gc.collect()
    before = rss_bytes()
    proc_stats.reset_peak_rss()
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    return value, seconds, before, proc_stats.peak_rss_bytes()


def _figures(seconds, before, peak, share) -> dict:
    return dict(seconds=seconds, rss_before_bytes=before, peak_rss_bytes=peak,
                delta_bytes=peak - before, share_bytes=share)


def _gather_consolidated(engine, groups, rank: int, target: str, total: int) -> None:
    """The consolidated checkpoint as ep_offload_backend.py wrote it: every record of every
    layer gathered to rank 0 (held until all are there), rank 0 writes one store checkpoint."""
    import torch.distributed as dist

    from moescale.offload.checkpoint import save_records

    store, gathered = engine.store, []
    for layer in range(len(store.layouts)):
        data, steps = zip(*(store.read_record((layer, e))
                            for e in range(store.num_experts[layer])))
        mine = torch.cat([torch.stack(data).reshape(-1), torch.tensor(steps)])
        del data
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())] \
            if rank == 0 else None
        dist.gather(mine, parts, dst=0, group=groups.ep_group)
        del mine
        if rank == 0:
            local, numel = store.num_experts[layer], store.layouts[layer].numel
            gathered.append((torch.cat([p[:local * 4 * numel].view(local, 4, numel)
                                        for p in parts]),
                             torch.cat([p[local * 4 * numel:] for p in parts])))
            del parts
    if rank == 0:
        os.makedirs(target, exist_ok=True)
        save_records(target, "consolidated", store.layouts, [total] * len(store.layouts),
                     lambda layer, e: (gathered[layer][0][e], float(gathered[layer][1][e])))
    dist.barrier()


def _share(engine) -> int:
    """Checkpoint bytes of this process's experts: master and two moments, fp32."""
    return sum(12 * lay.numel * n for lay, n in zip(engine.store.layouts,
                                                   engine.store.num_experts))


def save_phase(rank: int, world: int, args: dict, work: str) -> dict:
    from moescale.bench.offload import training_step
    from moescale.expert_state import save_expert_shards
    from moescale.parallel.groups import ParallelConfig, build_groups

    release_freed_memory()
    groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    model = _model(args, groups)
    engine = _offload(model, args, f"{work}/store-w{world}-r{rank}")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine.follow(opt)
        x = torch.randn(args["tokens"], args["d_model"])
        training_step(model, x, opt, engine)     # real moments in every record
        engine.store.drop_cache()
        share = _share(engine)
        entry, *fig = _measured(lambda: save_expert_shards(
            model, work, rank=rank, tag="bench", engine=engine))
        out = dict(entry=entry, save=_figures(*fig, share))
        if not args["no_gather"]:
            engine.store.drop_cache()
            _, *fig = _measured(lambda: _gather_consolidated(
                engine, groups, rank, f"{work}/consolidated", args["experts"]))
            out["consolidated"] = _figures(*fig, share)
        return out
    finally:
        engine.close()


def load_phase(rank: int, world: int, args: dict, work: str, entries: list) -> dict:
    from moescale.expert_state import load_expert_shards

    release_freed_memory()
    groups = None
    if world > 1:
        from moescale.parallel.groups import ParallelConfig, build_groups

        groups = build_groups(ParallelConfig(backend="gloo", timeout_s=600))
    model = _model(args, groups)
    engine = _offload(model, args, f"{work}/load-w{world}-r{rank}")
    try:
        share = _share(engine)
        result, *fig = _measured(lambda: load_expert_shards(model, work, entries,
                                                            engine=engine))
        steps = {engine.store.step_of(k) for k in engine.store.keys()}
        return dict(load=_figures(*fig, share), result=result, steps=sorted(steps))
    finally:
        engine.close()


def _filesystem(path: str) -> str:
    """The mount (device and type) holding `path`, from /proc/mounts."""
    best, found = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, kind = line.split()[:3]
                if path.startswith(mount) and len(mount) > len(best):
                    best, found = mount, f"{dev} {kind} on {mount}"
    except OSError:
        pass
    return found


def _row(name: str, rank: int, f: dict) -> str:
    return (f"  {name:<13} rank {rank}: peak RSS {f['peak_rss_bytes'] / MIB:7.0f} MiB (before "
            f"{f['rss_before_bytes'] / MIB:5.0f}, +{f['delta_bytes'] / MIB:6.0f}) vs its share "
            f"{f['share_bytes'] / MIB:6.0f} MiB, {f['seconds']:.1f} s")


def main(argv=None) -> int:
    from moescale.parallel.launch import run_local

    args = _parser().parse_args(argv)
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ[var] = "65536"           # the ranks inherit it (and call mallopt too)
    if args.experts % 2:
        raise ValueError(f"--experts={args.experts} must be even (2 expert-parallel ranks)")
    conf = dict(layers=args.layers, experts=args.experts, d_model=args.d_model,
                d_ff=args.d_ff, tokens=args.tokens, host_cache_mib=args.host_cache_mib,
                no_gather=args.no_gather)
    params = args.layers * args.experts * 2 * args.d_model * args.d_ff
    print(f"expert-shards: {args.layers} layers x {args.experts} experts, d_model "
          f"{args.d_model}, d_ff {args.d_ff}: checkpoint state (fp32 master + 2 moments) "
          f"{12 * params / GIB:.2f} GiB, disk-tier records {16 * params / GIB:.2f} GiB",
          flush=True)
    work = tempfile.mkdtemp(prefix="moescale-shards-", dir=args.dir)
    try:
        saved = run_local(save_phase, 2, (conf, work), timeout_s=900, deadline_s=1800)
        entries = [r.value["entry"] for r in saved]
        one = run_local(load_phase, 1, (conf, work, entries), timeout_s=900, deadline_s=1800)
        two = run_local(load_phase, 2, (conf, work, entries), timeout_s=900, deadline_s=1800)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    phases = {"save": [r.value["save"] for r in saved],
              "load-1": [r.value["load"] for r in one],
              "load-2": [r.value["load"] for r in two]}
    if not args.no_gather:
        phases["consolidated"] = [r.value["consolidated"] for r in saved]
    for name, ranks in phases.items():
        for rank, f in enumerate(ranks):
            print(_row(name, rank, f))
    ok = all(f["peak_rss_bytes"] < f["share_bytes"]
             for name in ("save", "load-1", "load-2") for f in phases[name])
    print(f"  every process below its own share while saving and loading: "
          f"{'PASS' if ok else 'FAIL'}")
    tag = hardware_tag(torch.device("cpu"))
    out = result_path(args.out, f"expert_shards_{tag}.json")
    write_json(out, dict(
        benchmark="expert-shards", hardware=tag, cpu_flags=disk_probe.cpu_flags(),
        config=conf, work_filesystem=_filesystem(work), checkpoint_state_bytes=12 * params,
        record_bytes=16 * params,
        phases=phases, adopted=[r.value["result"] for r in one + two],
        loaded_steps=[r.value["steps"] for r in one + two],
        targets=dict(peak_below_share=ok)))
    print(f"wrote {out}")
    return 0
