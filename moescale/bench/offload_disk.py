"""`moescale bench offload-disk`: training past RAM on the disk tier, measured at the device.

A stack of residual MoE layers is built on the meta device (the experts never exist in RAM:
`offload_moe(..., expert_init=...)` writes them straight to their files) and trained for a few
eager steps on the disk tier with a bounded host cache (1 GiB by default), in a **subprocess**
whose peak RSS (`ru_maxrss`) is reported. `--past-ram 1.3` sizes the number of experts so that
the expert state (16 bytes per parameter: fp32 master, gradient, two Adam moments) is 1.3x the
machine's physical RAM.

Reported per timed step: the step time; the bytes the store moved (its own counters) and the
bytes that reached the block device (/proc/self/io `read_bytes` / `write_bytes`: the page cache
cannot hide there); the scheme's minimum bytes (forward: the master row of every expert that
got tokens; backward and step: master and moments of every expert read and written; rows
padded to 4 KiB); the page-cache growth (/proc/meminfo `Cached`); the disk's busy time
(/proc/diskstats); and the time the main thread waited for expert uploads.

The floor: max(compute, bytes moved / bandwidth), the bandwidth that of the store's own I/O
path (direct I/O, same chunks, threads and requests in flight) with a read stream and a write
stream at once in the step's proportion (the device overlaps them: the sum of read time and
write time measured apart is reported too, and is not a floor), measured in the same run
after the warm-up step and after the timed steps, two interleaved rounds each, the best rate seen (this disk's
rate wanders between minutes; a floor must not be pessimistic). Reads come from the store's
own record files, each read once (cold: a probe file written just before is served by the
virtual disk's host cache at twice the disk's rate), beside `dd`
with direct I/O at the store's request size (the raw reference). Compute: the same layers with 2
resident experts and the same routed rows, plus host AdamW over every expert parameter at its
measured rate (median of warm timings).

Deliberately not here: the host-tier overhead (bench offload), the planner (bench plan-check).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moescale.bench import disk_probe
from moescale.bench.measure import hardware_tag, write_json
from moescale.bench.offload import MoEStack, training_step
from moescale.offload.direct_io import CHUNK_BYTES, align_up

GIB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench offload-disk",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--experts", type=int, default=32, help="experts per layer (ignored with "
                   "--past-ram)")
    p.add_argument("--past-ram", type=float, default=None, metavar="X", help="size the "
                   "experts so that the expert state is X times the physical RAM")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--host-cache-gb", type=float, default=1.0)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the simulated "
                   "device; cuda: pinned slots, side-stream uploads, direct reads into pinned "
                   "memory")
    p.add_argument("--device-budget-experts", type=float, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--probe-gb", type=float, default=2.0, help="size of each bandwidth probe")
    p.add_argument("--dir", default=None, help="where the expert files go (default: a temp "
                   "directory under /var/tmp)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def _expert_params(args) -> int:
    return 2 * args.d_model * args.d_ff


def _host_adam_rate(numel: int = 1 << 23, reps: int = 7) -> float:
    """Parameters per second of a fused host AdamW step (median of warm timings)."""
    from torch.optim.adamw import adamw
    p, g = torch.randn(numel), torch.randn(numel)
    m1, m2, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())
    kw = dict(foreach=False, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
              weight_decay=0.01, eps=1e-8, maximize=False)
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        adamw([p], [g], [m1], [m2], [], [step], **kw)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


def _compute_estimate(args) -> float:
    """Step time of the same layers with 2 resident experts (same routed rows)."""
    torch.manual_seed(0)
    model = MoEStack(args.layers, args.d_model, args.d_ff, 2, min(args.top_k, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.tokens * args.top_k // min(args.top_k, 2), args.d_model)
    times = []
    for _ in range(6):  # the first two are warm-up
        start = time.perf_counter()
        model(x).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _probe(args, cold: list[str], request_bytes: int, read_share: float,
           rounds: int = 2) -> dict:
    """The store path's read, write and mixed rates and dd's, interleaved `rounds` times, on
    cold record files of the store (each read once); the best of each."""
    nbytes = int(args.probe_gb * GIB)
    seen: dict[str, list[float]] = {}
    for _ in range(rounds):
        store = disk_probe.store_path_bandwidth(args.dir, cold, request_bytes, nbytes,
                                                threads=args.io_threads, read_share=read_share)
        dd = disk_probe.dd_bandwidth(args.dir, cold, request_bytes // CHUNK_BYTES * CHUNK_BYTES,
                                     nbytes, CHUNK_BYTES) or {}
        for key, value in [*((f"store_{k}", v) for k, v in store.items()),
                           *((f"dd_{k}", v) for k, v in dd.items())]:
            seen.setdefault(key, []).append(value)
    return {key: max(values) for key, values in seen.items()}


def _child(args) -> dict:
    from moescale.offload import OffloadConfig, offload_moe

    row = align_up(4 * _expert_params(args))
    experts = args.layers * args.experts
    read_share = (experts + 3 * experts) / (experts + 6 * experts)   # the scheme's mix
    compute_s = _compute_estimate(args)
    adam_rate = _host_adam_rate()
    torch.manual_seed(0)
    with torch.device("meta"):  # the experts never exist in RAM
        model = MoEStack(args.layers, args.d_model, args.d_ff, args.experts, args.top_k)

    def init(layer, e, layout):
        gen = torch.Generator().manual_seed(1000 * layer + e)
        return (torch.rand(layout.numel, generator=gen) - 0.5) * (2 / args.d_model ** 0.5)

    start = time.perf_counter()
    engine = offload_moe(model, OffloadConfig(
        tier="disk", directory=args.dir, host_cache_bytes=int(args.host_cache_gb * GIB),
        device=args.device, device_budget_experts=args.device_budget_experts,
        step_mode="eager", io_threads=args.io_threads), expert_init=init)
    init_s = time.perf_counter() - start
    store = engine.store
    probes = []
    model.to_empty(device=args.device)
    for moe in model.moes:
        torch.nn.init.normal_(moe.router.weight, std=0.02)
    for norm in model.norms:
        norm.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine.follow(opt)
    x = torch.randn(args.tokens, args.d_model, device=args.device)
    dev_io, busy = disk_probe.ProcessIO(), disk_probe.DiskBusy(args.dir)
    steps = []
    for i in range(1 + args.steps):
        if i == 1:   # the peak of the timed steps alone (not the probes' buffers)
            disk_probe.reset_peak_rss()
        read0, written0, wait0 = store.bytes_read, store.bytes_written, engine.cache.wait_seconds
        cached0 = disk_probe.page_cache_bytes()
        dev_io.take(), busy.take()
        cpu0 = os.times()
        start = time.perf_counter()
        training_step(model, x, opt, engine)
        store.flush()  # count the write-back of this step's records in this step
        elapsed = time.perf_counter() - start
        cpu1 = os.times()
        dev_read, dev_written = dev_io.take()
        routed = [int((moe.last_stats.routed_E > 0).sum()) for moe in model.moes]
        experts = sum(store.num_experts)
        steps.append(dict(
            seconds=elapsed, warmup=i == 0, bytes_read=store.bytes_read - read0,
            bytes_written=store.bytes_written - written0, device_read_bytes=dev_read,
            device_write_bytes=dev_written, disk_busy_s=busy.take(),
            page_cache_growth_bytes=disk_probe.page_cache_bytes() - cached0,
            upload_wait_s=engine.cache.wait_seconds - wait0,
            user_cpu_s=cpu1.user - cpu0.user, system_cpu_s=cpu1.system - cpu0.system,
            min_read_bytes=row * (sum(routed) + 3 * experts), min_write_bytes=3 * row * experts))
        s = steps[-1]
        if i == 0:   # the warm-up wrote every record whole: now the probe reads real files
            cold = [store.path(k) for k in store.keys()]
            random.Random(0).shuffle(cold)
            probes.append(_probe(args, cold, 3 * row, read_share))
        print(f"  step {i}{' (warm-up)' if i == 0 else ''}: {elapsed:.1f} s, read "
              f"{s['bytes_read'] / GIB:.2f} GiB (device {dev_read / GIB:.2f}), written "
              f"{s['bytes_written'] / GIB:.2f} GiB (device {dev_written / GIB:.2f}), disk busy "
              f"{s['disk_busy_s'] or 0:.1f} s, upload wait {s['upload_wait_s']:.1f} s, CPU user "
              f"{s['user_cpu_s']:.1f} s system {s['system_cpu_s']:.1f} s",
              flush=True)
    steps_peak_rss = disk_probe.peak_rss_bytes()
    peak_cache = store.peak_cache_bytes
    device_peak, device_budget = engine.device.peak_bytes, engine.device.budget_bytes
    direct = store.disk.io.direct
    cold = [store.path(k) for k in store.keys()]
    random.Random(1).shuffle(cold)
    engine.close()
    probes.append(_probe(args, cold, 3 * row, read_share))
    expert_params = _expert_params(args) * args.layers * args.experts
    return dict(expert_state_bytes=16 * expert_params, expert_params=expert_params,
                row_bytes=row, init_seconds=init_s, steps=steps, probes=probes,
                direct_io=direct, compute_resident_2experts_s=compute_s,
                host_adam_params_per_s=adam_rate, peak_host_cache_bytes=peak_cache,
                device_peak_bytes=device_peak, device_budget_bytes=device_budget,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                steps_peak_rss_bytes=steps_peak_rss)


def _best(probes: list[dict], key: str) -> float | None:
    values = [p[key] for p in probes if key in p]
    return max(values) if values else None


def _summarise(args, res: dict) -> dict:
    timed = [s for s in res["steps"] if not s["warmup"]] or res["steps"]

    def avg(key):
        return sum(s[key] for s in timed) / len(timed)
    step_s = statistics.median(s["seconds"] for s in timed)
    read_bw, write_bw = _best(res["probes"], "store_read"), _best(res["probes"], "store_write")
    mixed_bw = _best(res["probes"], "store_mixed")
    moved_read, moved_write = avg("device_read_bytes"), avg("device_write_bytes")
    # reads and writes in flight together, as in a step (the device overlaps them)
    io_floor = (moved_read + moved_write) / mixed_bw
    additive_floor = moved_read / read_bw + moved_write / write_bw
    compute = res["compute_resident_2experts_s"] + \
        res["expert_params"] / res["host_adam_params_per_s"]
    logical = avg("bytes_read") + avg("bytes_written")
    minimum = avg("min_read_bytes") + avg("min_write_bytes")
    out = dict(step_median_s=step_s, step_times_s=[s["seconds"] for s in timed],
               tokens_per_s=args.tokens / step_s, store_read_bytes_per_step=avg("bytes_read"),
               store_write_bytes_per_step=avg("bytes_written"),
               device_read_bytes_per_step=moved_read, device_write_bytes_per_step=moved_write,
               device_over_logical_reads=moved_read / max(1, avg("bytes_read")),
               min_bytes_per_step=minimum, moved_over_min=logical / minimum,
               page_cache_growth_max_bytes=max(s["page_cache_growth_bytes"] for s in timed),
               disk_busy_fraction=(avg("disk_busy_s") / step_s
                                   if all(s["disk_busy_s"] is not None for s in timed) else None),
               upload_wait_fraction=avg("upload_wait_s") / step_s,
               user_cpu_s_per_step=avg("user_cpu_s"), system_cpu_s_per_step=avg("system_cpu_s"),
               store_read_bytes_per_s=read_bw, store_write_bytes_per_s=write_bw,
               store_mixed_bytes_per_s=mixed_bw, io_floor_s=io_floor,
               io_floor_additive_s=additive_floor, compute_estimate_s=compute,
               step_over_floor=step_s / max(compute, io_floor))
    dd_read, dd_write = _best(res["probes"], "dd_read"), _best(res["probes"], "dd_write")
    if dd_read:
        out.update(dd_read_bytes_per_s=dd_read, dd_write_bytes_per_s=dd_write,
                   store_over_dd_read=read_bw / dd_read, store_over_dd_write=write_bw / dd_write)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.past_ram is not None:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_layer = 16 * _expert_params(args) * args.layers
        args.experts = int(-(-args.past_ram * ram // per_layer))
        argv = [*argv, "--experts", str(args.experts)]
    if args.child is not None:
        Path(args.child).write_text(json.dumps(_child(args)))
        return 0
    state = args.layers * args.experts * 4 * align_up(4 * _expert_params(args))
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="moescale-disk-", dir="/var/tmp")
        args.dir = tmp
    free = shutil.disk_usage(args.dir).free
    if free < state + 2 * args.probe_gb * GIB:
        raise ValueError(f"--dir {args.dir!r} has {free / GIB:.1f} GiB free; the expert state "
                         f"needs {state / GIB:.1f} GiB plus the bandwidth probes: choose another "
                         "--dir or a smaller model")
    print(f"expert state {state / GIB:.2f} GiB ({args.layers} layers x {args.experts} experts) "
          f"on the disk tier under {args.dir}, host cache {args.host_cache_gb} GiB; child "
          "process starting", flush=True)
    result_path = os.path.join(args.dir, "child-result.json")
    # the child parses the same options; the later --dir (the chosen one) wins
    cmd = [sys.executable, "-m", "moescale.bench.offload_disk", *argv, "--dir", args.dir,
           "--child", result_path]
    try:
        subprocess.run(cmd, check=True)
        res = json.loads(Path(result_path).read_text())
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    s = _summarise(args, res)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    targets = [
        ("expert state >= 1.3x physical RAM", res["expert_state_bytes"] >= 1.3 * ram,
         res["expert_state_bytes"] / ram),
        ("peak RSS <= 2.5 GiB", res["peak_rss_bytes"] <= 2.5 * GIB, res["peak_rss_bytes"]),
        ("page-cache growth <= 1 GiB", s["page_cache_growth_max_bytes"] <= GIB,
         s["page_cache_growth_max_bytes"]),
        ("device reads >= 0.95x the store's", s["device_over_logical_reads"] >= 0.95,
         s["device_over_logical_reads"]),
        ("step <= 1.25x max(compute, IO floor)", s["step_over_floor"] <= 1.25,
         s["step_over_floor"]),
        ("bytes moved <= 1.05x the scheme's minimum", s["moved_over_min"] <= 1.05,
         s["moved_over_min"])]
    if "store_over_dd_read" in s:
        targets.append(("store path >= 0.85x dd (read and write)",
                        min(s["store_over_dd_read"], s["store_over_dd_write"]) >= 0.85,
                        min(s["store_over_dd_read"], s["store_over_dd_write"])))
    print(f"\nexpert state        {res['expert_state_bytes'] / 1e9:.2f} GB "
          f"({res['expert_state_bytes'] / ram:.2f}x RAM), direct I/O {res['direct_io']}")
    print(f"peak RSS (child)    {res['peak_rss_bytes'] / GIB:.2f} GiB over the whole process "
          f"(bandwidth probes included), {res['steps_peak_rss_bytes'] / GIB:.2f} GiB in the "
          "timed steps")
    print(f"step (median)       {s['step_median_s']:.1f} s ({', '.join(f'{t:.1f}' for t in s['step_times_s'])}), "
          f"{s['tokens_per_s']:.1f} tokens/s")
    print(f"store per step      read {s['store_read_bytes_per_step'] / GIB:.2f} GiB, written "
          f"{s['store_write_bytes_per_step'] / GIB:.2f} GiB; minimum "
          f"{s['min_bytes_per_step'] / GIB:.2f} GiB (moved/min {s['moved_over_min']:.3f})")
    print(f"device per step     read {s['device_read_bytes_per_step'] / GIB:.2f} GiB "
          f"({s['device_over_logical_reads']:.3f}x the store's), written "
          f"{s['device_write_bytes_per_step'] / GIB:.2f} GiB; page cache grew at most "
          f"{s['page_cache_growth_max_bytes'] / 2**20:.0f} MiB")
    line = (f"store path          read {s['store_read_bytes_per_s'] / 1e9:.2f} GB/s, write "
            f"{s['store_write_bytes_per_s'] / 1e9:.2f} GB/s, both at once "
            f"{s['store_mixed_bytes_per_s'] / 1e9:.2f} GB/s")
    if "dd_read_bytes_per_s" in s:
        line += (f"; dd direct read {s['dd_read_bytes_per_s'] / 1e9:.2f}, write "
                 f"{s['dd_write_bytes_per_s'] / 1e9:.2f} GB/s (store/dd "
                 f"{s['store_over_dd_read']:.2f}, {s['store_over_dd_write']:.2f})")
    print(line)
    busy = s["disk_busy_fraction"]
    print(f"floor               IO {s['io_floor_s']:.1f} s (reads and writes one after the other: "
          f"{s['io_floor_additive_s']:.1f} s), compute {s['compute_estimate_s']:.1f}"
          f" s; step / floor = {s['step_over_floor']:.2f}; disk busy "
          f"{'n/a' if busy is None else f'{100 * busy:.0f}%'}, main thread waiting on uploads "
          f"{100 * s['upload_wait_fraction']:.0f}%")
    for name, ok, _ in targets:
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    tag = hardware_tag(torch.device(args.device))
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"offload_disk_{tag}.json"
    write_json(out, dict(benchmark="offload-disk", hardware=tag, cpu_flags=disk_probe.cpu_flags(),
                         physical_ram_bytes=ram,
                         config={k: v for k, v in vars(args).items() if k != "child"},
                         result=res, **s,
                         targets=[dict(name=n, passed=ok, value=v) for n, ok, v in targets]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
