"""A run's checkpoints, seen from the trainer: resume from the newest good one, save one,
set aside those not trusted after a divergence.

`resume(trainer)` loads the newest checkpoint whose dense half and expert store both verify
(falling back past corrupt ones, which it renames `.corrupt`, never deleting them);
`save(trainer)` is collective: every rank writes the experts it holds, then its part of the
dense half (dense_dcp.py), then rank 0 the commit point and drops the checkpoints neither
`train.keep_last` nor trust.py keeps;
`set_aside_diverged(trainer)` renames the checkpoints written within trust.TRUST_STEPS of a
divergence to `.diverged` and says which checkpoint to continue from.

Not here: the file formats (checkpoint.py, run_state.py), the loop (trainer.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moescale.offload.checkpoint import StoreCheckpointError
from moescale.offload.direct_io import CorruptReadError
from moescale.train.checkpoint import (CheckpointError, checkpoint_path, list_checkpoints,
                                       nonfinite, save_checkpoint, verified_checkpoints)
from moescale.train.config import to_dict
from moescale.train.guard import TrainingDiverged
from moescale.train.named_state import local_tensors
from moescale.train.run_state import FORMAT as RUN_STATE_FORMAT
from moescale.train.trust import TRUST_STEPS


def _or_last_error(found, failed: list[str]):
    """`found`, whose exhaustion error names the last load failure when it was no checksum's."""
    try:
        yield from found
    except CheckpointError as err:
        text = str(err).lstrip("; ")
        raise CheckpointError(f"{failed[-1]}; {text}" if failed else text) from None


def resume(trainer) -> None:
    """Resume from the newest checkpoint whose dense half and expert store both verify
    (a corrupt store falls back to the previous checkpoint, as a corrupt dense file does;
    the store is verified before anything of it is loaded; a checkpoint of another model,
    too)."""
    warn = lambda m: print(m, file=trainer.err)   # noqa: E731
    for path, tensors, state in _or_last_error(verified_checkpoints(trainer.ckpt_dir, warn),
                                               failed := []):
        error = None
        try:
            trainer.parts.state.load(trainer.ckpt_dir, tensors, state)
        except (StoreCheckpointError, CheckpointError) as err:   # every rank falls back
            error = err
        except (RuntimeError, KeyError, ValueError) as err:     # another model's: fall back
            error = CheckpointError(f"checkpoint {str(path)!r} does not fit this model/config "
                                    f"({str(err).splitlines()[0]}); resume with the run's own "
                                    "config.toml")
        if not trainer.ranks.any(error is not None):
            break
        reason = str(error).splitlines()[0] if error else "another rank's experts failed"
        failed.append(reason)
        warn(f"warning: {reason}; trying the previous checkpoint")
    trainer.step = int(state["step"])
    if trainer.threads_auto:     # the count the run chose (the same floats), not a new choice
        trainer.config.train.threads = state["config"]["train"].get("threads") or \
            trainer.config.train.threads
    trainer.batches.load_state(state["data_rng"])
    torch.set_rng_state(tensors["rng.torch"])
    if trainer.device.type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], trainer.device)
    trainer.ranks.barrier()    # every rank has read before rank 0 renames
    for newer_step, newer in list_checkpoints(trainer.ckpt_dir) if trainer.writer else ():
        if newer_step > trainer.step:   # failed verification: set aside, never deleted
            newer.rename(newer.with_name(newer.name + ".corrupt"))
    trainer.metrics.truncate_after(trainer.step)
    trainer.resumed_from = str(path)
    print(f"resumed from {path} (step {trainer.step})", file=trainer.err)

def save(trainer) -> Path:
    """Collective: every rank writes the experts it holds, then its part of the dense half
    (DCP), then rank 0 the commit point (run_state.py)."""
    run_state = trainer.parts.state
    tensors, opt_rest = run_state.dense_state()
    rng = {"rng.torch": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["rng.cuda"] = torch.cuda.get_rng_state(trainer.device)
    state = {"step": trainer.step, "format": RUN_STATE_FORMAT, "optimizer": opt_rest,
             "data_rng": trainer.batches.state(), "config": to_dict(trainer.config)}
    path = checkpoint_path(trainer.ckpt_dir, trainer.step)
    bad = nonfinite(local_tensors(tensors)) or run_state.nonfinite_experts()   # own shards
    if trainer.ranks.any(bad is not None):               # every rank stops, none waits
        raise TrainingDiverged(
            f"refusing to write the checkpoint of step {trainer.step}: " +
            (f"{bad[0]} holds {bad[1]:,} NaN or Inf values" if bad else "another rank found "
             "NaN or Inf") + "; the checkpoints already written are finite: lower optim.lr")
    failed = entry = dense = None
    try:
        trainer.ckpt_dir.mkdir(parents=True, exist_ok=True)
        entry = run_state.save_experts(trainer.ckpt_dir, trainer.step)     # first
    except OSError as err:     # disk full, read-only: the older checkpoints stand
        failed = err
    entries = [e for e in trainer.ranks.gather_objects(entry) if e is not None]
    shards_failed = trainer.ranks.any(failed is not None)
    if not shards_failed:
        try:                   # collective: a failure on one rank raises on every rank
            dense = run_state.save_dense(tensors, trainer.ckpt_dir, trainer.step)
        except OSError as err:
            failed = err
    if trainer.writer and dense is not None:
        try:
            steps = [s for s, _ in list_checkpoints(trainer.ckpt_dir)] + [trainer.step]
            protect = trainer.trust.protected(steps, trainer.step,
                                              final=trainer.step == trainer.config.train.steps)
            path = save_checkpoint(trainer.ckpt_dir, trainer.step, rng, dict(
                state, expert_shards=entries, dense=dense), trainer.config.train.keep_last,
                protect)                                                        # commit
            if trainer.step > 0 and 0 not in protect:   # the initial state: a safety net only
                checkpoint_path(trainer.ckpt_dir, 0).unlink(missing_ok=True)
            run_state.after_save(trainer.ckpt_dir)
        except OSError as err:
            failed = err
    if trainer.ranks.any(failed is not None) or shards_failed:
        if isinstance(failed, CorruptReadError):    # a damaged store file: said as it is
            raise failed
        reason = failed.strerror or str(failed) if failed else "another rank failed"
        raise OSError(getattr(failed, "errno", None), f"could not write the checkpoint of "
                      f"step {trainer.step} in {str(trainer.ckpt_dir)!r} ({reason}); the "
                      "checkpoints already written are intact")
    trainer.ranks.barrier()
    return path


def set_aside_diverged(trainer) -> str:
    """Rename the checkpoints not trusted over an older one to `.diverged` (trust.py);
    the advice of the stop message: which checkpoint to continue from."""
    found = list_checkpoints(trainer.ckpt_dir)
    keep = trainer.trust.resume_point([s for s, _ in found], trainer.step)
    if keep is None:
        return f"no checkpoint was written: start {trainer.run_dir} again"
    later = [(s, p) for s, p in found if s > keep]
    if trainer.writer:
        for _, path in later:
            path.rename(path.with_name(path.name + ".diverged"))
    many = "s" * (len(later) > 1)
    aside = (f" (the checkpoint{many} of step{many} {', '.join(str(s) for s, _ in later)}, "
             f"written within {TRUST_STEPS} steps of the divergence, set aside as *.diverged)"
             if later else "")
    return (f"continue from the checkpoint of step {keep} "
            f"({checkpoint_path(trainer.ckpt_dir, keep).name}){aside} with --resume "
            f"{trainer.run_dir}")
