"""The fault soak: more kills than CI runs, with the numbers written down.

    .venv/bin/python tests/faults/soak.py [--kills 30] [--disk-kills 8] [--shm-trials 20]

1. kill -9 during dense checkpoint writes, `--kills` times over one run (kill_loop.py), and the
   same on the disk tier (`--offload.mode disk`, through the public CLI only): every kill lands
   while a checkpoint temp file exists, every resume starts from the newest checkpoint that
   verifies, the next start removes the kill's temp files, and the losses equal an
   uninterrupted run's bit for bit.
2. Dynamic placement on 2 ranks: `--shm-trials` times, SIGTERM or SIGKILL (random) of a random
   rank at a random moment (0-40 ms) after the shared store file appears in /dev/shm; then no
   store file may be left.

Prints a table and writes benchmarks/results/faults_<hardware>.json. Not run by pytest (the CI
tests in this folder run a smaller share of the same code).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "train")]

from fault_helpers import (Launcher, losses, rank_env, shm_stores, tiny_args,  # noqa: E402
                           wait_for)
from kill_loop import kill_resume_loop, loop_args  # noqa: E402
from train_helpers import small_corpus  # noqa: E402


def kill_series(launcher, corpus, base: Path, name: str, steps: int, kills: int,
                extra: dict) -> dict:
    ref_dir, run_dir = base / f"{name}-reference", base / f"{name}-killed"
    args = loop_args(corpus, ref_dir, steps, **extra)
    code, text = launcher.run(args, base, timeout=600)
    assert code == 0, text
    t0 = time.perf_counter()
    res = kill_resume_loop(launcher, corpus, run_dir, steps=steps, kills=kills, seed=1,
                           extra=extra)
    return {"kills": res.kills, "resumes": res.resumes, "steps": steps,
            "kills_during_a_write": sum(n >= 1 for n in res.left_after_kill),
            "temp_files_after_kills": sum(res.left_after_kill),
            "temp_files_surviving_next_start": sum(res.left_after_start),
            "sweep_lines": res.swept_lines, "final_exit": res.final_code,
            "temp_files_at_end": len(res.final_temps),
            "losses_bitwise_equal": res.losses == losses(ref_dir),
            "seconds": round(time.perf_counter() - t0, 1)}


def shm_trials(launcher, corpus, base: Path, trials: int) -> dict:
    rng = random.Random(7)
    before = shm_stores()
    rows = []
    from moescale.parallel.launch import free_port

    for trial in range(trials):
        victim, sig = rng.randrange(2), rng.choice([signal.SIGTERM, signal.SIGKILL])
        delay = rng.uniform(0.0, 0.04)
        args = ["train", *tiny_args(corpus, base / f"shm{trial}", train__steps="3",
                                    parallel__placement="dynamic", model__d_model="128",
                                    model__d_ff="512", model__num_experts="8")]
        port = free_port()
        ranks = [launcher.start(args, base, log=base / f"shm{trial}-rank{r}.log",
                                env=rank_env(r, 2, port)) for r in range(2)]
        seen = wait_for(lambda: shm_stores() - before, 60, poll=0) is not None
        time.sleep(delay)
        os.kill(ranks[victim].pid, sig)
        codes = [r.wait(120) for r in ranks]
        left = sorted(shm_stores() - before)
        rows.append({"victim_rank": victim, "signal": sig.name, "delay_ms": round(delay * 1e3, 1),
                     "file_seen": seen, "exit_codes": codes, "files_left": left})
    return {"trials": trials, "files_left": sum(len(r["files_left"]) for r in rows),
            "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--disk-kills", type=int, default=8)
    ap.add_argument("--shm-trials", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    args = ap.parse_args()
    import torch

    from moescale.bench.measure import hardware_tag, write_json

    launcher = Launcher()
    with tempfile.TemporaryDirectory(prefix="moescale-soak-") as tmp:
        base = Path(tmp)
        corpus = small_corpus(base / "corpus")
        out = {"dense": kill_series(launcher, corpus, base, "dense", 2 * args.kills,
                                    args.kills, {})}
        if args.disk_kills:
            out["disk"] = kill_series(launcher, corpus, base, "disk", 3 * args.disk_kills,
                                      args.disk_kills, {"offload__mode": "disk"})
        if args.shm_trials and os.path.isdir("/dev/shm"):
            out["shm"] = shm_trials(launcher, corpus, base, args.shm_trials)
    for name in ("dense", "disk"):
        if name in out:
            print(f"{name:5s} " + ", ".join(f"{k} {v}" for k, v in out[name].items()))
    if "shm" in out:
        print(f"shm   {out['shm']['trials']} trials, {out['shm']['files_left']} store files left")
    tag = hardware_tag(torch.device("cpu"))
    path = Path(args.out) if args.out else \
        HERE.parents[1] / "benchmarks" / "results" / f"faults_{tag}.json"
    write_json(path, {"benchmark": "faults", **out})
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in out.items() if k != "shm"}, indent=1))


if __name__ == "__main__":
    main()
