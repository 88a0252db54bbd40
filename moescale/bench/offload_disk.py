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

`--verify-ab`: the cost of verified reads (every disk-tier read checked against the sums of its
write, on by default). Twice the timed steps on the same store, verification on and off in
ABBA order (on, off, off, on, ...), so drift in the disk's rate falls on both alike; reported:
the median step of each, their ratio, and the readers' seconds spent hashing.

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

from moescale import proc_stats
from moescale.bench import disk_probe
from moescale.bench.measure import hardware_tag, result_path, write_json
from moescale.bench.offload import MoEStack, training_step
from moescale.bench.offload_disk_report import print_run, summarise, targets
from moescale.offload.direct_io import CHUNK_BYTES
from moescale.offload.records import POS_GRAD, POS_MASTER
from moescale.offload.state_format import RecordGeometry, StateFormat, parse_formats

GIB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench offload-disk",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2, help="MoE layers of the stack")
    p.add_argument("--d-model", type=int, default=1024, help="model width")
    p.add_argument("--d-ff", type=int, default=4096, help="expert hidden width")
    p.add_argument("--experts", type=int, default=32, help="experts per layer (ignored with "
                   "--past-ram)")
    p.add_argument("--past-ram", type=float, default=None, metavar="X", help="size the "
                   "experts so that the expert state is X times the physical RAM")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--host-cache-gb", type=float, default=1.0, help="the disk tier's host "
                   "cache of expert records, GiB (its real host memory)")
    p.add_argument("--io-threads", type=int, default=4, help="disk reader and writer threads "
                   "each")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the simulated "
                   "device; cuda: pinned slots, side-stream uploads, direct reads into pinned "
                   "memory")
    p.add_argument("--device-budget-experts", type=float, default=3, help="device budget in "
                   "experts (compute-precision copies)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--verify-ab", action="store_true", help="time each step with verified "
                   "reads on and off (2 x --steps timed steps, ABBA order, the same store)")
    p.add_argument("--probe-gb", type=float, default=2.0, help="size of each bandwidth probe")
    p.add_argument("--dir", default=None, help="where the expert files go (default: a temp "
                   "directory under /var/tmp); each format's files are removed after its run "
                   "unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the expert files under --dir")
    p.add_argument("--formats", default="fp32+fp32,bf16+int8", help="expert state formats to "
                   "run back to back on the same experts, each MASTER+MOMENTS (master fp32 | "
                   "bf16, moments fp32 | bf16 | int8), comma-separated")
    p.add_argument("--out", default=None, help="the JSON result (default: runs/bench/<time>/"
                   "offload_disk_<hardware>.json)")
    p.add_argument("--step-mode", choices=("eager", "deferred"), default="eager",
                   help="eager: each expert steps right after its backward; deferred: every "
                   "expert after the whole backward (its gradient row goes to disk and back)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--format", default="fp32+fp32", help=argparse.SUPPRESS)   # the child's
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
        block = max(4096, min(CHUNK_BYTES, request_bytes) // 4096 * 4096)  # small records too
        dd = disk_probe.dd_bandwidth(args.dir, cold, request_bytes // block * block, nbytes,
                                     block) or {}
        for key, value in [*((f"store_{k}", v) for k, v in store.items()),
                           *((f"dd_{k}", v) for k, v in dd.items())]:
            seen.setdefault(key, []).append(value)
    return {key: max(values) for key, values in seen.items()}


def _child(args) -> dict:
    from moescale.offload import OffloadConfig, offload_moe

    fmt = parse_formats(args.format)[0]
    geo = RecordGeometry(fmt, _expert_params(args))
    master_row, state_rows = geo.strides[POS_MASTER], geo.offsets[POS_GRAD]
    grad_row, deferred = geo.strides[POS_GRAD], int(args.step_mode == "deferred")
    read_share = (master_row + state_rows) / (master_row + 2 * state_rows)  # the scheme's mix
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
        step_mode=args.step_mode, io_threads=args.io_threads, master=fmt.master,
        moments=fmt.moments), expert_init=init)
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
    dev_io, busy = proc_stats.ProcessIO(), disk_probe.DiskBusy(args.dir)
    steps = []
    io = store.disk.io
    for i in range(1 + args.steps * (2 if args.verify_ab else 1)):
        if i == 1:   # the peak of the timed steps alone (not the probes' buffers)
            proc_stats.reset_peak_rss()
        store.disk.verify_reads = not args.verify_ab or i == 0 or (i - 1) % 4 in (0, 3)
        hashed0, hash_s0 = io.bytes_verified, io.verify_s
        read0, written0, wait0 = store.bytes_read, store.bytes_written, engine.wait_seconds
        optim0, optim_cpu0 = engine.optimizer.step_seconds, engine.optimizer.step_cpu_seconds
        cached0 = proc_stats.page_cache_bytes()
        dev_io.take(), busy.take()
        cpu0 = os.times()
        start = time.perf_counter()
        loss = training_step(model, x, opt, engine)
        store.flush()  # count the write-back of this step's records in this step
        elapsed = time.perf_counter() - start
        cpu1 = os.times()
        dev_read, dev_written = dev_io.take()
        routed = [int((moe.last_stats.routed_E > 0).sum()) for moe in model.moes]
        experts = sum(store.num_experts)
        steps.append(dict(
            seconds=elapsed, warmup=i == 0, loss=loss, bytes_read=store.bytes_read - read0,
            bytes_written=store.bytes_written - written0, device_read_bytes=dev_read,
            device_write_bytes=dev_written, disk_busy_s=busy.take(),
            page_cache_growth_bytes=proc_stats.page_cache_bytes() - cached0,
            upload_wait_s=engine.wait_seconds - wait0,
            user_cpu_s=cpu1.user - cpu0.user, system_cpu_s=cpu1.system - cpu0.system,
            optimizer_s=engine.optimizer.step_seconds - optim0,
            optimizer_cpu_s=engine.optimizer.step_cpu_seconds - optim_cpu0,
            # deferred: backward reads the master again, and the gradient row goes out
            # after backward and comes back for the step
            min_read_bytes=master_row * sum(routed) + state_rows * experts + deferred * (
                master_row * sum(routed) + grad_row * experts),
            min_write_bytes=(state_rows + deferred * grad_row) * experts,
            verify=store.disk.verify_reads,
            bytes_verified=io.bytes_verified - hashed0, verify_s=io.verify_s - hash_s0))
        s = steps[-1]
        if i == 0:   # the warm-up wrote every record whole: now the probe reads real files
            cold = [store.path(k) for k in store.keys()]
            random.Random(0).shuffle(cold)
            probes.append(_probe(args, cold, state_rows, read_share))
        ab = f" (verified reads {'on' if s['verify'] else 'off'})" if args.verify_ab else ""
        print(f"  step {i}{' (warm-up)' if i == 0 else ab}: {elapsed:.1f} s, loss {loss:.4g}, read "
              f"{s['bytes_read'] / GIB:.2f} GiB (device {dev_read / GIB:.2f}), written "
              f"{s['bytes_written'] / GIB:.2f} GiB (device {dev_written / GIB:.2f}), disk busy "
              f"{s['disk_busy_s'] or 0:.1f} s, upload wait {s['upload_wait_s']:.1f} s, CPU user "
              f"{s['user_cpu_s']:.1f} s system {s['system_cpu_s']:.1f} s, host optimizer "
              f"{s['optimizer_s']:.1f} s (its CPU {s['optimizer_cpu_s']:.1f} s)",
              flush=True)
    steps_peak_rss = proc_stats.peak_rss_bytes()
    peak_cache = store.peak_cache_bytes
    device_peak, device_budget = engine.device_peak_bytes, engine.device_budget_bytes
    direct = store.disk.io.direct
    cold = [store.path(k) for k in store.keys()]
    random.Random(1).shuffle(cold)
    engine.close()
    probes.append(_probe(args, cold, state_rows, read_share))
    expert_params = _expert_params(args) * args.layers * args.experts
    return dict(format=fmt.name, format_fields=dict(master=fmt.master, moments=fmt.moments),
                expert_state_bytes=16 * expert_params,
                expert_params=expert_params, record_bytes=geo.total,
                files_bytes=args.layers * args.experts * geo.total,
                master_row_bytes=master_row, state_row_bytes=state_rows, init_seconds=init_s,
                steps=steps, probes=probes,
                direct_io=direct, compute_resident_2experts_s=compute_s,
                host_adam_params_per_s=adam_rate, peak_host_cache_bytes=peak_cache,
                device_peak_bytes=device_peak, device_budget_bytes=device_budget,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                steps_peak_rss_bytes=steps_peak_rss)


def _check(args) -> list[StateFormat]:
    for name in ("layers", "d_model", "d_ff", "experts", "top_k", "tokens", "steps",
                 "io_threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("host_cache_gb", "probe_gb", "device_budget_experts"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    if args.past_ram is not None and not args.past_ram > 0:
        raise ValueError(f"--past-ram {args.past_ram} must be > 0")
    if args.top_k > args.experts and args.past_ram is None:
        raise ValueError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    return parse_formats(args.formats)


def _run_format(args, argv: list[str], fmt: StateFormat) -> tuple[dict, dict]:
    """One child process training the experts in `fmt`; its result and summary."""
    geo = RecordGeometry(fmt, _expert_params(args))
    state = args.layers * args.experts * geo.offsets[POS_GRAD]   # blocks (gradient rows sparse)
    root = args.dir or tempfile.mkdtemp(prefix="moescale-disk-", dir="/var/tmp")
    os.makedirs(root, exist_ok=True)
    where = tempfile.mkdtemp(prefix=f"offload-disk-{fmt.master}-{fmt.moments}-", dir=root)
    try:
        free = shutil.disk_usage(where).free
        if free < state + 2 * args.probe_gb * GIB:
            raise ValueError(f"--dir {root!r} has {free / GIB:.1f} GiB free; the expert state "
                             f"({fmt.name}) needs {state / GIB:.1f} GiB plus the bandwidth "
                             "probes: choose another --dir or a smaller model")
        print(f"\n[{fmt.name}] expert state {state / GIB:.2f} GiB ({args.layers} layers x "
              f"{args.experts} experts) on the disk tier under {where}, host cache "
              f"{args.host_cache_gb} GiB; child process starting", flush=True)
        result_path = os.path.join(where, "child-result.json")
        # the child parses the same options; the later --dir and --format win
        cmd = [sys.executable, "-m", "moescale.bench.offload_disk", *argv, "--dir", where,
               "--format", f"{fmt.master}+{fmt.moments}", "--child", result_path]
        subprocess.run(cmd, check=True)
        res = json.loads(Path(result_path).read_text())
    finally:
        if not args.keep:
            shutil.rmtree(where if args.dir else root, ignore_errors=True)
    return res, summarise(args, res)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        formats = _check(args)
        parse_formats(args.format)
    except ValueError as err:
        print(f"moescale bench offload-disk: {err}", file=sys.stderr)
        return 2
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if args.past_ram is not None:   # sized by fp32 state: every format trains these experts
        per_layer = 16 * _expert_params(args) * args.layers
        args.experts = int(-(-args.past_ram * ram // per_layer))
        argv = [*argv, "--experts", str(args.experts)]
    if args.child is not None:
        Path(args.child).write_text(json.dumps(_child(args)))
        return 0
    try:
        runs = [_run_format(args, argv, fmt) for fmt in formats]
    except ValueError as err:
        print(f"moescale bench offload-disk: {err}", file=sys.stderr)
        return 2
    records = []
    for res, s in runs:
        checks = targets(res, s, ram)
        print_run(res, s, ram, checks)
        records.append(dict(result=res, **s, targets=[dict(name=n, passed=ok, value=v)
                                                      for n, ok, v in checks]))
    base = runs[0][1]
    print(f"\n{'format':<26} {'bytes/param/step':>16} {'minimum':>8} {'step s':>7} "
          f"{'step / first':>12} {'optimizer share':>15}")
    for res, s in runs:
        print(f"{res['format']:<26} {s['device_bytes_per_param_per_step']:>16.2f} "
              f"{s['min_bytes_per_param_per_step']:>8.2f} {s['step_median_s']:>7.1f} "
              f"{s['step_median_s'] / base['step_median_s']:>12.3f} "
              f"{100 * s['optimizer_share_of_step']:>14.0f}%")
    tag = hardware_tag(torch.device(args.device))
    out = result_path(args.out, f"offload_disk_{tag}.json")
    write_json(out, dict(benchmark="offload-disk", hardware=tag, cpu_flags=disk_probe.cpu_flags(),
                         physical_ram_bytes=ram,
                         config={k: v for k, v in vars(args).items() if k not in ("child",
                                                                                  "format")},
                         runs=records,
                         step_over_first=[s["step_median_s"] / base["step_median_s"]
                                          for _, s in runs]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
