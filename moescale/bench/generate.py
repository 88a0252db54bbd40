"""`moescale bench generate`: KV-cached generation with disk-tier experts, bytes per token vs the
minimum and tokens/s vs the disk's rate.

    moescale bench generate --size tiny --experts 16 --memory 64MiB --tokens 100
    moescale bench generate --run runs/big --memory 3GiB --tokens 100      # a trained run
    moescale bench generate --size moe-s --experts 64 --memory 1GiB --tokens 200 --dir /var/tmp

The model is a trained run's (`--run`: moescale.train.streamed.open_run, its checkpoint's
record files adopted by hard link) or a named size with random weights built on the meta
device (`--size`, `--experts`, `--top-k`, `--layers`: its experts written straight to their
files under `--dir`, one at a time; the master rows only, 4 bytes per parameter; routers
N(0, 1), so that tokens spread over the experts: a random init's near-zero router sends nearly
every token to the same few, which would flatter the cache). Either way
the experts stay on the disk tier, the host cache gets what `--memory` leaves after the dense
weights, the KV cache and the device copies (streamed.memory_plan), and `--tokens` tokens are
sampled (`--temperature`, default 1, seeded: greedy decoding makes a random model repeat one
token, and one expert path) after a `--prompt-tokens` random prompt, measured by gen_stats.py
per phase.

Reported for decode, per generated token:
- `device_read`: /proc/self/io read_bytes (what reached the block device);
- `min_read`: the master rows of the routed experts the host cache did not hold (the store's
  misses x one master row): what any reader must move given this cache's contents;
- `routed`: the master rows of every routed expert (what a forward reads with no cache; the
  issue's "<= 1.1x the routed experts' bytes");
- tokens/s beside the disk bound: the store path's cold read rate (disk_probe, direct I/O at
  one master row per request, on the store's own files before generation) / min_read;
- the host cache's hit rate, the seconds compute waited for experts, peak RSS per phase (and
  the RSS before the model was built: the interpreter and torch, outside --memory);
- with `--prefetch`, a second KV-cached pass with next-layer prefetch (the next MoE layer's
  router applied to the current layer's input, its picks read ahead: streamed.NextLayerPrefetch),
  its tokens/s, bytes and the share of guessed experts the layer then used;
- with `--recompute`, the same tokens generated as before the KV cache (the whole window per
  token) through the same cache: what the KV cache saves.

The result goes to benchmarks/results/generate_<hardware>[_<tag>].json with the CPU flags.

Deliberately not here: the streaming itself (moescale.train.streamed, moescale.offload).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from moescale.bench import disk_probe
from moescale.bench.measure import hardware_tag, write_json
from moescale.sizes import parse_size

GIB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moescale bench generate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--run", default=None, help="a `moescale train` run directory (default: a "
                   "random model of --size)")
    p.add_argument("--size", default="tiny", help="named size of the random model (tiny, "
                   "small, moe-s, moe-m, moe-l)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (random model)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (random model)")
    p.add_argument("--layers", type=int, default=None, help="layers (random model)")
    p.add_argument("--seq-len", type=int, default=None, help="context window (random model)")
    p.add_argument("--memory", default="1GiB", help="host memory for the model (dense, KV "
                   "cache, device copies, host cache), e.g. 1GiB")
    p.add_argument("--tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--prompt-tokens", type=int, default=8, help="length of the random prompt "
                   "(token ids)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature "
                   "(seeded; 0: greedy, which makes a random model repeat one token)")
    p.add_argument("--recompute", action="store_true", help="also generate as before the KV "
                   "cache (the whole window per token), for comparison: reads far more")
    p.add_argument("--prefetch", action="store_true", help="also generate with next-layer "
                   "prefetch (streamed.NextLayerPrefetch), for comparison")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--probe-mb", type=float, default=256, help="bytes read by the disk probe")
    p.add_argument("--dir", default=None, help="random model: where its expert files go (a "
                   "temp directory in it, removed at the end; default /var/tmp)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/...)")
    return p


def _random_model(args, memory: int, directory: str):
    from moescale.layers.moe import MoE
    from moescale.models import GPT, gpt_config
    from moescale.offload import OffloadConfig, offload_moe
    from moescale.offload.records import M
    from moescale.train.streamed import DEVICE_EXPERTS, memory_plan

    overrides = {k: v for k, v in (("num_experts", args.experts), ("top_k", args.top_k),
                                   ("n_layers", args.layers), ("seq_len", args.seq_len))
                 if v is not None}
    torch.manual_seed(0)
    model = GPT(gpt_config(args.size, **overrides), expert_device="meta")
    with torch.no_grad():    # decisive routers: tokens spread over the experts (a random
        for moe in model.modules():     # init's near-zero router sends most to the same few)
            if isinstance(moe, MoE):
                moe.router.weight.normal_(std=1.0)
    plan = memory_plan(model, memory, batch=1)
    engine = offload_moe(model, OffloadConfig(
        tier="disk", directory=directory, device="cpu", device_budget_experts=DEVICE_EXPERTS,
        host_cache_bytes=max(plan.host_cache, 2 * plan.record_bytes)),
        expert_init=model.expert_init)
    engine.store.set_slot_rows(M, plan.host_cache)      # generation reads masters alone
    return model.eval(), engine, plan


def _disk_rate(engine, directory: str, master_bytes: int, nbytes: int) -> float | None:
    """The store path's cold read rate at one master row per request (bytes/s)."""
    store = engine.store
    cold = [store.path(k) for k in store.keys()]
    random.Random(0).shuffle(cold)
    if not cold:
        return None
    rates = disk_probe.store_path_bandwidth(directory, cold, master_bytes,
                                            min(nbytes, master_bytes * len(cold)))
    return rates.get("read")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run(args) -> dict:
    from moescale.train.gen_stats import GenerationMeter
    from moescale.train.streamed import NextLayerPrefetch, open_run, release_freed_memory

    memory = parse_size(args.memory, "--memory")
    if args.threads:
        torch.set_num_threads(args.threads)
    made = None
    rss_before = _rss()           # the interpreter and torch, before any model
    start = time.perf_counter()
    if args.run:
        opened = open_run(args.run, experts="disk", memory=memory)
        model, engine, plan = opened.model, opened.engine, opened.plan
        directory = str(opened.directory)
    else:
        directory = made = tempfile.mkdtemp(prefix="moescale-gen-", dir=args.dir or "/var/tmp")
        opened = None
        try:
            model, engine, plan = _random_model(args, memory, directory)
        except BaseException:
            shutil.rmtree(made, ignore_errors=True)
            raise
    setup_s = time.perf_counter() - start
    release_freed_memory()
    try:
        rate = _disk_rate(engine, directory, plan.master_bytes, int(args.probe_mb * 2**20))
        release_freed_memory()       # the probe's buffers
        idx_1S = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(0))
        with torch.no_grad():    # warm-up (first-call costs), then a cold host cache
            model.generate(idx_1S, 4, temperature=0)
        engine.store.drop_cache()
        meter = GenerationMeter(model, engine)
        wait0 = engine.wait_seconds
        with torch.no_grad():
            model.generate(idx_1S, args.tokens, temperature=args.temperature,
                           generator=torch.Generator().manual_seed(1), on_token=meter.on_token)
        wait_s = engine.wait_seconds - wait0
        stats = meter.summary()
        if args.prefetch:
            engine.store.drop_cache()
            again, prefetch = GenerationMeter(model, engine), NextLayerPrefetch(model, engine)
            try:
                with torch.no_grad():
                    model.generate(idx_1S, args.tokens, temperature=args.temperature,
                                   generator=torch.Generator().manual_seed(1),
                                   on_token=again.on_token)
            finally:
                prefetch.close()
            stats["prefetch"] = dict(again.summary(), accuracy=prefetch.accuracy)
        if args.recompute:
            engine.store.drop_cache()
            again = GenerationMeter(model, engine)
            with torch.no_grad():
                model.generate(idx_1S, args.tokens, temperature=args.temperature,
                               generator=torch.Generator().manual_seed(1), kv_cache=False,
                               on_token=again.on_token)
            stats["recompute"] = again.summary()
    finally:
        if opened is not None:
            opened.close()
        else:
            engine.close()
        if made:
            shutil.rmtree(made, ignore_errors=True)
    d = stats["decode"]
    n = max(1, d["tokens"])
    min_read = d["expert_reads"] * plan.master_bytes / n
    cfg = model.config
    return dict(
        hardware=hardware_tag(torch.device("cpu")), cpu_flags=disk_probe.cpu_flags(),
        threads=torch.get_num_threads(), source=args.run or f"random {args.size}",
        temperature=args.temperature,
        model=dict(n_layers=cfg.n_layers, d_model=cfg.d_model, d_ff=cfg.moe.d_ff,
                   num_experts=cfg.moe.num_experts, top_k=cfg.moe.top_k, glu=cfg.moe.glu,
                   seq_len=cfg.seq_len, vocab_size=cfg.vocab_size),
        memory_bytes=memory, memory_plan=dict(plan.__dict__, cached_experts=plan.cached_experts),
        setup_s=setup_s, disk_read_bytes_per_s=rate, expert_wait_s=wait_s, phases=stats,
        decode=dict(tokens=d["tokens"], tokens_per_s=d["tokens_per_s"],
                    device_read_per_token=d["read_bytes"] / n, min_read_per_token=min_read,
                    routed_per_token=d["routed_bytes_per_token"], hit_rate=d["hit_rate"],
                    device_over_min=d["read_bytes"] / n / min_read if min_read else None,
                    device_over_routed=(d["read_bytes"] / n / d["routed_bytes_per_token"]
                                        if d["routed_bytes_per_token"] else None),
                    disk_bound_tokens_per_s=rate / min_read if rate and min_read else None,
                    peak_rss=d["peak_rss"]),
        prefill_peak_rss=stats["prefill"]["peak_rss"], rss_before_model=rss_before)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    result = run(args)
    d, mib = result["decode"], 2**20
    fmt = (lambda v, f: format(v, f) if v is not None else "n/a")
    print(f"{result['source']}: {result['model']}, memory {args.memory} "
          f"({result['memory_plan']['cached_experts']} experts cached), setup "
          f"{result['setup_s']:.1f} s")
    print(f"decode: {d['tokens']} tokens, {d['tokens_per_s']:.2f} tokens/s (disk bound "
          f"{fmt(d['disk_bound_tokens_per_s'], '.2f')}), device read "
          f"{d['device_read_per_token'] / mib:.2f} MiB/token, minimum "
          f"{d['min_read_per_token'] / mib:.2f} (x{fmt(d['device_over_min'], '.3f')}), routed "
          f"{d['routed_per_token'] / mib:.2f} (x{fmt(d['device_over_routed'], '.3f')}), "
          f"hit rate {fmt(d['hit_rate'], '.1%')}, peak RSS {d['peak_rss'] / mib:.0f} MiB "
          f"(prefill {result['prefill_peak_rss'] / mib:.0f} MiB; before the model "
          f"{result['rss_before_model'] / mib:.0f} MiB)")
    if "prefetch" in result["phases"]:
        r = result["phases"]["prefetch"]
        print(f"with next-layer prefetch: {r['decode']['tokens_per_s']:.2f} tokens/s, device "
              f"read {r['decode']['read_bytes_per_token'] / mib:.2f} MiB/token (wrong guesses "
              f"are reads too), guesses right {fmt(r['accuracy'], '.1%')}")
    if "recompute" in result["phases"]:
        r = result["phases"]["recompute"]
        seconds = r["prefill"]["seconds"] + r["decode"]["seconds"]
        print(f"recompute (no KV cache): {args.tokens / seconds:.2f} tokens/s, device read "
              f"{(r['prefill']['read_bytes'] + r['decode']['read_bytes']) / args.tokens / mib:.2f}"
              f" MiB/token, hit rate {fmt(r['decode']['hit_rate'], '.1%')}")
    out = Path(args.out) if args.out else Path("benchmarks/results") / (
        f"generate_{result['hardware']}{'_' + args.tag if args.tag else ''}.json")
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
