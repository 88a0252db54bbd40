"""`train_distributed(config, run_dir, world_size)`: `moescale train` on N local processes.

The Python-API twin of `torchrun --nproc-per-node N -m moescale train ...`: real processes
through `moescale.parallel.launch.run_local` (gloo on CPU, NCCL on GPU; gloo for dynamic
placement, whose experts compute on the host copy), each running a Trainer; returns rank 0's
exit code and summary. `residency=` reaches every rank's Trainer: a "module:name" or
"path/to/file.py:name" string (each rank imports it) or a picklable Residency or factory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moescale.parallel.launch import run_local
from moescale.train.config import RunConfig, load_config, to_dict
from moescale.train.trainer import Trainer

# What each rank imports before its first step (the trainer; torch._dynamo with the first
# optimizer step, ~1.7 s): imported once by the fork server instead of once per rank.
RANK_MODULES = ("moescale.train.launch", "torch._dynamo")


def _rank_main(rank: int, world_size: int, tree: dict, run_dir: str, quiet: bool,
               resume: bool, residency=None):
    config = load_config(None, None, base=tree)
    out = open(os.devnull, "w") if quiet or rank else None
    trainer = Trainer(config, run_dir, resume=resume, out=out, err=out, residency=residency)
    code = trainer.run()
    return code, getattr(trainer, "summary", None) if rank == 0 else None


def train_distributed(config: RunConfig, run_dir: str | Path, world_size: int, *,
                      resume: bool = False, quiet: bool = False, deadline_s: float = 3600.0,
                      residency=None):
    """Train `config` on `world_size` local processes (gloo on CPU, NCCL on GPU); returns
    (exit code, rank 0's summary). resume=True: `--resume run_dir`, with `config` as the full
    config. residency: the ranks' own residency (module docstring)."""
    backend = config.parallel.backend
    if backend == "auto":       # dynamic placement computes on the host copy
        backend = "nccl" if torch.cuda.is_available() and config.parallel.placement == "static" \
            else "gloo"
    results = run_local(_rank_main, world_size,
                        (to_dict(config), str(run_dir), quiet, resume, residency),
                        backend=backend, timeout_s=config.parallel.timeout_s,
                        deadline_s=deadline_s, preload=RANK_MODULES)
    return results[0].value
