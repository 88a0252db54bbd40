"""What this machine can run, checked before `moescale train` allocates or writes anything.

A configuration can be valid and still impossible here: more threads than CPUs (torch starts
them all; past the process's thread limit it segfaults), a model or batch whose memory exceeds
the machine's by orders of magnitude (an allocation traceback, or the OOM killer, minutes
later), a run directory that is a file or cannot be written. Each check raises ValueError with
the values and the fix (`moescale train` prints it as one line, exit 2):

- `check_threads`: train.threads <= the CPUs this process may use;
- `check_memory`: a lower bound of the bytes training needs (parameters x 16 bytes of fp32
  weights, gradients and AdamW moments in the memory that holds them, plus the activations of
  one micro-batch) against what is available (RAM + free swap; a CUDA device's total memory
  for what lives there). The model is counted on the meta device, so nothing is allocated. A
  lower bound never refuses a run that fits; it catches the typos (1e8 for 1e3);
- `check_run_dir`: the run directory is a directory, or can be created, and can be written
  (probed with a temp file in its nearest existing folder; nothing is created);
- `claim_run_dir`: the run directory belongs to this run while it lives (moescale/dir_lock.py:
  a second start or `--resume` of a live run refuses in one line naming the owner).

Not here: validation of single options (config.py), the planner's estimates (offload/planner).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from moescale.dir_lock import LOCK_NAME, DirLock, claim_directory
from moescale.layers.expert_threads import usable_cpus
from moescale.sizes import fmt_bytes
from moescale.train.config import RunConfig

STATE_BYTES = 16       # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq
ACT_BYTES = 4


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but no CUDA device is available; use cpu or "
                         "auto")
    return torch.device(name)


def check_threads(threads: int, option: str = "train.threads") -> None:
    """A thread count (0 = auto) must not exceed the CPUs this process may run on."""
    cpus = usable_cpus()
    if threads > cpus:
        raise ValueError(f"{option}={threads} is more than the {cpus} CPUs this process "
                         f"may use; give at most {cpus} (or 0: chosen from the load)")


def _available_ram() -> int:
    """MemAvailable + SwapFree from /proc/meminfo (total RAM where that is missing)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def training_bytes(config: RunConfig, vocab_size: int, cap: float = math.inf
                   ) -> tuple[int, int, int]:
    """(parameters, bytes of parameter state held in RAM or on the device, activation bytes of
    one micro-batch): lower bounds, from the model built on the meta device (from a formula
    alone when that already exceeds `cap` bytes)."""
    from moescale.models import GPT
    from moescale.train.model import model_config

    cfg = model_config(config, vocab_size)
    d, d_ff = cfg.d_model, cfg.moe.d_ff
    moe_layers = 0 if not cfg.moe_every else cfg.n_layers // cfg.moe_every
    least_expert = moe_layers * cfg.moe.num_experts * 2 * d * d_ff
    least = cfg.n_layers * 2 * d * d + cfg.vocab_size * d     # q and o projections at least
    held = least + (0 if config.offload.tier == "disk" else
                    least_expert // max(1, config.parallel.ep_size))
    if STATE_BYTES * held > cap:     # refused by a lower bound: building the model, even on
        return least + least_expert, STATE_BYTES * held, 0     # meta, can take minutes
    with torch.device("meta"):
        count = GPT(cfg).num_parameters()
    expert = count.expert // max(1, config.parallel.ep_size)
    if config.offload.tier == "disk":
        expert = 0                    # on disk, behind a bounded host cache
    state = STATE_BYTES * (count.total - count.expert + expert)
    B, S = config.train.batch_size, config.train.seq_len
    per_token = cfg.n_layers * (8 * cfg.d_model + cfg.n_heads * S + 2 * cfg.moe.top_k * d_ff) \
        + 2 * cfg.vocab_size
    return count.total, state, ACT_BYTES * B * S * per_token


def check_memory(config: RunConfig, vocab_size: int, device: torch.device) -> None:
    """Refuse a model + micro-batch that cannot fit (see the module docstring)."""
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device} has"
    else:
        have, where = _available_ram(), "this machine has"
    params, state, acts = training_bytes(config, vocab_size, cap=have)
    t = config.train     # + the validation windows, held for the run (ids and targets, int64)
    need = state + acts + 16 * t.eval_batches * t.batch_size * t.seq_len
    cache = config.offload.host_cache_bytes
    if config.offload.tier == "disk" and cache is not None and cache > _available_ram():
        raise ValueError(f"offload.host_cache_bytes={cache:,} is more than the "
                         f"{fmt_bytes(_available_ram())} of RAM available; give a smaller cache "
                         "(or leave it unset: chosen from the expert state and the RAM)")
    if need <= have:
        return
    m, t = config.model, config.train
    shown = ", ".join(f"{name} {getattr(m, name)}" for name in
                      ("n_layers", "d_model", "n_heads", "d_ff", "num_experts", "top_k")
                      if getattr(m, name) is not None)
    raise ValueError(
        f"model {m.hf or m.size!r}{f' ({shown})' if shown else ''}, vocabulary {vocab_size}, with "
        f"train.batch_size={t.batch_size} x train.seq_len={t.seq_len} needs at least "
        f"{fmt_bytes(need)} ({params:,} parameters: "
        f"{fmt_bytes(state)} of weights, gradients and AdamW state; {fmt_bytes(acts)} of "
        f"activations) but {where} {fmt_bytes(have)} available; shrink the model or the "
        "batch (train.grad_accum keeps the batch with smaller micro-batches), or keep the "
        "experts on disk (offload.tier disk)")


def check_run_dir(run_dir: str | Path, option: str = "train.run_dir") -> None:
    """The run directory is a directory (or can be made one) and can be written."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option}={str(run_dir)!r} is a file, not a directory; choose a "
                         "directory (it is created if missing)")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{option}={str(run_dir)!r} cannot be created: {str(probe)!r} is a "
                         "file; choose a directory path")
    try:
        fd, name = tempfile.mkstemp(prefix=".moescale-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise ValueError(f"{option}={str(run_dir)!r} is not writable ({err.strerror or err} in "
                         f"{str(probe)!r}); choose a directory you can write") from None


BYTES_PER_PARAM_DEVICE_ONLY = 16   # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


def check_budget(config: RunConfig, num_params: int) -> None:
    """A device budget smaller than what device-only training holds is a user error."""
    if config.offload.tier != "device-only":
        return    # the offload engine checks its budget against one expert
    budget = config.offload.device_budget_bytes
    need = num_params * BYTES_PER_PARAM_DEVICE_ONLY
    if budget is not None and budget < need:
        raise ValueError(
            f"offload.device_budget_bytes={budget:,} bytes is too "
            f"small: device-only training of {num_params:,} parameters holds {need:,} bytes of "
            "weights, gradients and AdamW state; raise the budget or use a smaller model")


# what a run creates, rewrites or deletes inside its directory (a planted link is refused)
RUN_ENTRIES = ("checkpoints", "expert-store", "metrics.jsonl", "tensorboard", "hf")


def claim_run_dir(run_dir: Path, resume: bool, ranks) -> DirLock | None:
    """Rank 0 creates the run directory and holds its lock (every rank refuses together when it
    cannot); the lock is the caller's to release. A directory this call created is marked
    (`created`) so that a start that fails in set-up can remove it again (`unclaim`)."""
    lock, error = None, None
    if ranks.writer:
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fix = ("stop it first (Ctrl-C or SIGTERM saves a checkpoint), then resume it"
                   if resume else "wait for it to end or choose another train.run_dir")
            lock = claim_directory(run_dir, f"run directory {str(run_dir)!r}", fix)
            lock.created = created
            links = [n for n in RUN_ENTRIES if (run_dir / n).is_symlink()]
            if links:
                lock.release()
                raise ValueError(f"{str(run_dir / links[0])!r} is a symbolic link; a run never "
                                 "follows one where it writes and deletes: remove it")
        except (OSError, ValueError) as err:
            error = err
    if ranks.any(error is not None):
        if error is None:
            raise ValueError(f"rank 0 could not claim the run directory {str(run_dir)!r}")
        if isinstance(error, OSError):
            raise ValueError(f"train.run_dir={str(run_dir)!r} cannot be created "
                             f"({error.strerror or error}); choose a directory you can "
                             "write") from None
        raise error
    return lock


def unclaim(lock: DirLock | None) -> None:
    """Release a run directory's lock; remove the directory when the claim created it and
    nothing else was written there (a start that failed in set-up leaves no trace)."""
    if lock is None:
        return
    path = Path(lock.path).parent
    lock.release()
    if getattr(lock, "created", False):
        files = [f for _, _, names in os.walk(path) for f in names if f != LOCK_NAME]
        if not files:      # empty folders (checkpoints/) at most
            shutil.rmtree(path, ignore_errors=True)
