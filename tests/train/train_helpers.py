"""Shared helpers for the training tests: a small real text corpus, tiny-model overrides, a
tiny run's config, copies of a run to resume, and the comparison of two runs' records."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moescale.train.config import RunConfig, load_config
from moescale.train.data import stdlib_files

TINY = {"model.n_layers": "2", "model.d_model": "32", "model.n_heads": "2", "model.d_ff": "64",
        "model.num_experts": "4", "model.top_k": "2", "train.batch_size": "4",
        "train.seq_len": "32", "train.eval_batches": "2", "train.threads": "1",
        "train.sample_tokens": "0", "train.progress": "false", "train.report": "false", "optim.warmup_steps": "2"}


def small_corpus(folder: Path, num_files: int = 24) -> Path:
    """Copies of real standard-library sources (a few hundred KB), as a directory corpus."""
    root, files = stdlib_files()
    folder.mkdir(parents=True, exist_ok=True)
    picked = [f for f in files if "/" not in f and f.endswith(".py")][:num_files]
    for rel in picked:
        (folder / rel).write_bytes((root / rel).read_bytes()[:20000])
    return folder


def tiny_run_config(corpus: Path, run_dir: Path, *, steps: int, every: int, keep_last: int,
                    **extra: str) -> RunConfig:
    """TINY on `corpus` for `steps` steps, evaluating and checkpointing every `every` steps
    (keeping `keep_last`) into `run_dir`; `extra`: further overrides."""
    overrides = dict(TINY, **{"data.path": str(corpus), "train.steps": str(steps),
                              "train.checkpoint_interval": str(every),
                              "train.eval_interval": str(every),
                              "train.keep_last": str(keep_last), "train.run_dir": str(run_dir)})
    overrides.update(extra)
    return load_config(None, overrides)


def as_argv(overrides: dict[str, str]) -> list[str]:
    out = []
    for key, value in overrides.items():
        out += [f"--{key}", value]
    return out


def moescale_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "moescale", *args]


def resume_copy(src, dst, step: int):
    """A copy of run directory `src` at `dst` whose only checkpoint is the one of `step` (its
    commit file, its dense directory and its expert shards)."""
    import shutil
    from pathlib import Path

    from moescale.train.checkpoint import checkpoint_path, load_checkpoint

    shutil.copytree(src, dst)
    commit = checkpoint_path(Path(dst) / "checkpoints", step)
    keep = {commit.name, f"expert-shards-{step:08d}",
            (load_checkpoint(commit)[1].get("dense") or {}).get("dir")}
    for entry in (Path(dst) / "checkpoints").iterdir():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return Path(dst)


def checkpoint_tensors(run_dir, step: int):
    """(every tensor of a run's checkpoint of `step`: the commit file's and its dense half's,
    whole; its JSON state)."""
    from moescale.train.checkpoint import checkpoint_path, load_checkpoint
    from moescale.train.dense_dcp import consolidated

    ckpt_dir = Path(run_dir) / "checkpoints"
    tensors, state = load_checkpoint(checkpoint_path(ckpt_dir, step))
    return dict(tensors, **consolidated(ckpt_dir, state["dense"])), state


def run_records(run_dir) -> list[dict]:
    """The train and validation records of a run's metrics.jsonl."""
    from moescale.train.metrics import read_metrics

    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl")
            if r["kind"] in ("train", "val")]


def assert_same_run(got: list[dict], want: list[dict], first_step: int = 0,
                    grad_norm: bool = True) -> None:
    """`got` logs `want`'s steps after `first_step` with its numbers: losses within 1e-5
    relative (fp32), grad norms within 1e-4, identical routed token counts."""
    import pytest

    want = [r for r in want if r["step"] > first_step]
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    checks = (("loss", 1e-5), ("val_loss", 1e-5), ("aux_loss", 1e-5)) + \
        ((("grad_norm", 1e-4),) if grad_norm else ())
    for a, b in zip(got, want):
        for key, rel in checks:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-7), (key, a["step"])
        assert a.get("tokens_per_expert") == b.get("tokens_per_expert"), a["step"]


def train_run(config: RunConfig, run_dir, ranks: int, steps: int, resume: bool = False) -> None:
    """Train `config` in `run_dir` on `ranks` processes (real gloo ranks, or the Trainer on
    this one) to `steps`, quietly; asserts it finished."""
    import os

    from moescale.train.launch import train_distributed
    from moescale.train.trainer import Trainer

    if ranks > 1:
        code, summary = train_distributed(config, run_dir, ranks, resume=resume, quiet=True,
                                          deadline_s=150)
        assert code == 0 and summary["world_size"] == ranks and summary["step"] == steps
    else:
        trainer = Trainer(config, run_dir, resume=resume, out=open(os.devnull, "w"),
                          err=open(os.devnull, "w"))
        assert trainer.run() == 0


def continue_run(src, dst, overrides: dict[str, str], ranks: int, step: int) -> list[dict]:
    """Resume a copy of run `src` from its checkpoint of `step` with `overrides` on `ranks`
    processes (the Python API) to the end; the records it logged after that checkpoint."""
    import os

    from moescale.toml_compat import tomllib
    from moescale.train.launch import train_distributed
    from moescale.train.trainer import Trainer

    run_dir = resume_copy(src, dst, step)
    base = tomllib.loads((run_dir / "config.toml").read_text())
    config = load_config(None, dict(overrides, **{"train.run_dir": str(run_dir)}), base=base)
    if ranks > 1:
        code, summary = train_distributed(config, run_dir, ranks, resume=True, quiet=True,
                                          deadline_s=100)
        assert code == 0 and summary["world_size"] == ranks
        assert summary["step"] == config.train.steps
    else:
        trainer = Trainer(config, run_dir, resume=True, out=open(os.devnull, "w"))
        assert trainer.step == step and trainer.run() == 0
    return [r for r in run_records(run_dir) if r["step"] > step]


def torchrun_train(options: dict[str, str], cwd, timeout_s: float, ranks: int = 2,
                   nodes: int = 1) -> str:
    """`torchrun [--nnodes nodes] --nproc-per-node ranks -m moescale train` with `options`, the
    ranks forked from the warm fork server (tests/warm_runner.py); asserts that every rank
    exited 0 and returns their output."""
    from warm_runner import run_warm_torchrun
    code, output = run_warm_torchrun(ranks, ["train", *as_argv(options)], cwd,
                                     dict(os.environ), timeout_s, nodes=nodes)
    assert code == 0, output[-6000:]
    return output
