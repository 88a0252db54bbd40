"""`moescale bench offload-disk`'s summary of a child's measurements: per-step averages, the
floor, bytes per expert parameter, verified reads on / off (`--verify-ab`), the targets, the
printed block of one format's run.

Deliberately not here: running the steps and the probes (offload_disk.py).
"""

from __future__ import annotations

import statistics

from moescale.bench.stats import paired_ratio

GIB = 1 << 30


# Ceilings on device bytes per expert parameter per step (issue 27's targets), by format.
BYTES_CEILING = {"master=bf16,moments=int8": 10.5, "master=fp32,moments=int8": 18.0}


def _best(probes: list[dict], key: str) -> float | None:
    values = [p[key] for p in probes if key in p]
    return max(values) if values else None


def summarise(args, res: dict) -> dict:
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
    params = res["expert_params"]
    out = dict(format=res["format"], step_median_s=step_s,
               step_times_s=[s["seconds"] for s in timed],
               device_bytes_per_param_per_step=(moved_read + moved_write) / params,
               min_bytes_per_param_per_step=minimum / params,
               optimizer_s_per_step=avg("optimizer_s"),
               optimizer_share_of_step=avg("optimizer_s") / step_s,
               optimizer_cpu_s_per_step=avg("optimizer_cpu_s"),
               step_mode=getattr(args, "step_mode", "eager"),
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
    on = [s for s in timed if s.get("verify", True)]
    off = [s for s in timed if not s.get("verify", True)]
    if on and off:     # --verify-ab: the same store, interleaved
        on_s, off_s = (statistics.median(s["seconds"] for s in part) for part in (on, off))
        out["verify_ab"] = dict(
            on_median_s=on_s, off_median_s=off_s, on_over_off=on_s / off_s, steps_each=len(on),
            on_times_s=[s["seconds"] for s in on], off_times_s=[s["seconds"] for s in off],
            hash_s_per_step=sum(s["verify_s"] for s in on) / len(on),
            bytes_verified_per_step=sum(s["bytes_verified"] for s in on) / len(on))
        if min(len(on), len(off)) >= 2:   # ABBA: the k-th on and off steps ran side by side
            pairs = min(len(on), len(off))
            out["verify_ab"]["paired"] = paired_ratio([s["seconds"] for s in on[:pairs]],
                                                      [s["seconds"] for s in off[:pairs]]
                                                      ).as_dict()
    dd_read, dd_write = _best(res["probes"], "dd_read"), _best(res["probes"], "dd_write")
    if dd_read:
        out.update(dd_read_bytes_per_s=dd_read, dd_write_bytes_per_s=dd_write,
                   store_over_dd_read=read_bw / dd_read, store_over_dd_write=write_bw / dd_write)
    return out


def targets(res: dict, s: dict, ram: int) -> list[tuple[str, bool, float]]:
    targets = [
        ("expert parameters' fp32 state >= 1.3x physical RAM",
         res["expert_state_bytes"] >= 1.3 * ram, res["expert_state_bytes"] / ram),
        ("peak RSS <= 2.5 GiB", res["peak_rss_bytes"] <= 2.5 * GIB, res["peak_rss_bytes"]),
        ("page-cache growth <= 1 GiB", s["page_cache_growth_max_bytes"] <= GIB,
         s["page_cache_growth_max_bytes"]),
        ("device reads >= 0.95x the store's", s["device_over_logical_reads"] >= 0.95,
         s["device_over_logical_reads"]),
        ("step <= 1.25x max(compute, IO floor)", s["step_over_floor"] <= 1.25,
         s["step_over_floor"]),
        ("bytes moved <= 1.05x the scheme's minimum", s["moved_over_min"] <= 1.05,
         s["moved_over_min"])]
    ceiling = BYTES_CEILING.get(res["format"])     # eager steps' ceilings
    if ceiling is not None and s.get("step_mode", "eager") == "eager":
        targets.append((f"device bytes per expert parameter per step <= {ceiling}",
                        s["device_bytes_per_param_per_step"] <= ceiling,
                        s["device_bytes_per_param_per_step"]))
    if "verify_ab" in s:   # the paired ratio where there are pairs, else the medians'
        ab = s["verify_ab"]
        cost = ab["paired"]["ratio"] if "paired" in ab else ab["on_over_off"]
        targets.append(("verified reads move the step time <= 3%", cost <= 1.03, cost))
    if "store_over_dd_read" in s:
        targets.append(("store path >= 0.85x dd (read and write)",
                        min(s["store_over_dd_read"], s["store_over_dd_write"]) >= 0.85,
                        min(s["store_over_dd_read"], s["store_over_dd_write"])))
    return targets


def print_run(res: dict, s: dict, ram: int, targets) -> None:
    print(f"\n[{res['format']}] expert files {res['files_bytes'] / 1e9:.2f} GB (the fp32 "
          f"state of these {res['expert_params'] / 1e9:.2f}B expert parameters: "
          f"{res['expert_state_bytes'] / 1e9:.2f} GB = {res['expert_state_bytes'] / ram:.2f}x "
          f"RAM), direct I/O {res['direct_io']}")
    print(f"peak RSS (child)    {res['peak_rss_bytes'] / GIB:.2f} GiB over the whole process "
          f"(bandwidth probes included), {res['steps_peak_rss_bytes'] / GIB:.2f} GiB in the "
          "timed steps")
    print(f"step (median)       {s['step_median_s']:.1f} s "
          f"({', '.join(f'{t:.1f}' for t in s['step_times_s'])}), "
          f"{s['tokens_per_s']:.1f} tokens/s; host optimizer {s['optimizer_s_per_step']:.1f} s "
          f"per step ({100 * s['optimizer_share_of_step']:.0f}% of the step, on its worker; "
          f"its CPU {s['optimizer_cpu_s_per_step']:.1f} s)")
    print(f"bytes per parameter {s['device_bytes_per_param_per_step']:.2f} per step at the "
          f"device (the scheme's minimum {s['min_bytes_per_param_per_step']:.2f})")
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
    ab = s.get("verify_ab")
    if ab:
        paired = ab.get("paired")
        interval = "" if paired is None else (
            f", paired {paired['ratio']:.3f}x [{paired['low']:.3f}, {paired['high']:.3f}] (95% "
            f"CI, n={paired['n']})")
        print(f"verified reads      on {ab['on_median_s']:.2f} s, off {ab['off_median_s']:.2f} s "
              f"per step (medians of {ab['steps_each']} each, ABBA): on/off "
              f"{ab['on_over_off']:.3f}{interval}; the readers hashed "
              f"{ab['bytes_verified_per_step'] / GIB:.2f} GiB per step in "
              f"{ab['hash_s_per_step']:.2f} s (their threads, beside the step)")
    for name, ok, _ in targets:
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
