"""Checkpoints: one self-verifying safetensors file per saved step, written atomically.

A checkpoint `ckpt_<step>.safetensors` holds tensors (a run's RNG state; in checkpoints before
the dense half went through DCP also the model parameters and buffers under `model.` and the
AdamW state under `optim.`) and, in the safetensors metadata, a JSON `state` (step, config,
data generator state, optimizer hyper-parameters, the name and manifest sum of the run's DCP
dense directory, anything small) and a `sha256` over that JSON and every tensor's bytes in name
order. It is a run's commit point: written last. Nothing is pickled.

Writing goes to a temp file in the same directory, is fsynced, then `os.replace`d into place, so
a crash leaves either the old set or the new one. After a save only the newest `keep_last`
checkpoints are kept. Loading verifies the checksum; a truncated or corrupted file raises
`CheckpointError` with the path and the reason, and `load_latest` then falls back to the
previous checkpoint (reporting what it skipped), never deleting the bad file itself.

No checkpoint holds NaN or Inf: `save_checkpoint` refuses such tensors before writing anything
(`NonFiniteError`), and loading refuses them too (a file written before this check, by a
diverged run), so `load_latest` falls back to the previous checkpoint. A kill mid-write leaves
temp files (ours, safetensors' `.tmpXXXXXX`, partial `*.tmp` store and DCP directories) or a
DCP dense directory no commit file names (train/dense_dcp.py); the next start removes them
with `sweep_temp_files` (`remove_unnamed_dense`).

This file knows nothing of the training loop beyond "a dict of tensors plus a JSON state".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from moescale.atomic import atomic_path, is_temp_name

_NAME = re.compile(r"ckpt_(\d{8})\.safetensors")
_ANY_NAME = re.compile(r"ckpt_(\d{8})\.safetensors(\.corrupt|\.diverged)?")
DENSE_DIR = re.compile(r"dense-(\d{8})-([0-9a-f]{8})")     # train/dense_dcp.py's directories
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")   # save_file's temp, renamed when done


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (truncated, corrupted, or not ours)."""


class NonFiniteError(CheckpointError):
    """Tensors holding NaN or Inf: never written, never loaded."""


def _digest(state_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(state_json.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checkpoint_path(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"ckpt_{step:08d}.safetensors"


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in the directory, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), ckpt_dir / m.group(0))
             for m in map(_NAME.fullmatch, os.listdir(ckpt_dir)) if m]
    return sorted(found)


def nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """(name, count) of the first floating tensor, in name order, holding NaN or Inf."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name, int((~torch.isfinite(t)).sum())
    return None


def check_finite(tensors: dict[str, torch.Tensor], step: int) -> None:
    """NonFiniteError unless every floating tensor of step `step`'s checkpoint is finite."""
    found = nonfinite(tensors)
    if found is not None:
        raise NonFiniteError(f"refusing to write the checkpoint of step {step}: {found[0]} "
                             f"holds {found[1]:,} non-finite values (NaN or Inf); the "
                             "checkpoints already written are left as they are")


def save_checkpoint(ckpt_dir: str | Path, step: int, tensors: dict[str, torch.Tensor],
                    state: dict, keep_last: int, protect: frozenset[int] = frozenset()) -> Path:
    """Write `ckpt_<step>` atomically, then drop all but the newest `keep_last` and those of
    the steps in `protect` (trust.py). Refuses (NonFiniteError, nothing written) when a
    floating tensor holds NaN or Inf."""
    check_finite(tensors, step)
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    flat = {}
    for name, value in tensors.items():   # tied weights share storage: store a copy each
        value = value.detach().contiguous().cpu()
        ptr = value.untyped_storage().data_ptr() if value.numel() else -1
        flat[name] = value.clone() if ptr in seen else value
        seen.add(ptr)
    tensors = flat
    state_json = json.dumps(state, sort_keys=True)
    meta = {"state": state_json, "sha256": _digest(state_json, tensors), "format": "moescale/1"}
    final = checkpoint_path(ckpt_dir, step)
    with atomic_path(final) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except SafetensorError as err:   # its I/O errors (disk full, read-only) as OSError
            code = re.search(r"os error (\d+)", str(err))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(final)) \
                from None
    for old_step, old in list_checkpoints(ckpt_dir)[:-keep_last]:
        if old_step not in protect:
            old.unlink(missing_ok=True)
    return final


def sweep_temp_files(run_dir: str | Path) -> tuple[int, int]:
    """Remove what killed writers left in a run directory and its checkpoints folder (files
    of atomic_path, safetensors' own `.tmpXXXXXX`, partial `*.tmp` directories, dense
    directories that no commit point names: remove_unnamed_dense); returns
    (entries removed, bytes freed). Run it before the run writes anything: a temp name
    belongs to no live writer then."""
    run_dir = Path(run_dir)
    found: list[Path] = [p for p in run_dir.iterdir() if p.is_file() and _is_temp(p.name)] \
        if run_dir.is_dir() else []
    ckpt_dir = run_dir / "checkpoints"
    for root, dirs, files in os.walk(ckpt_dir) if ckpt_dir.is_dir() else ():
        found += [Path(root, d) for d in dirs if d.endswith(".tmp")]
        dirs[:] = [d for d in dirs if not d.endswith(".tmp")]
        found += [Path(root, f) for f in files if _is_temp(f)]
    freed = 0
    for path in found:
        if path.is_dir() and not path.is_symlink():
            freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path, ignore_errors=True)
        else:
            freed += path.lstat().st_size
            path.unlink(missing_ok=True)
    orphans, orphan_bytes = remove_unnamed_dense(ckpt_dir)
    return len(found) + orphans, freed + orphan_bytes


def dense_dirs_named(ckpt_dir: str | Path) -> tuple[set[str], set[int]]:
    """(the dense directories that commit points in `ckpt_dir` name, set-aside ones included;
    the steps of commit points whose metadata cannot be read: their directories are kept)."""
    named, unread = set(), set()
    for m in map(_ANY_NAME.fullmatch, os.listdir(ckpt_dir)):
        if not m:
            continue
        try:
            with safe_open(str(Path(ckpt_dir, m.group(0))), "pt") as f:
                dense = json.loads((f.metadata() or {}).get("state", "{}")).get("dense")
        except (SafetensorError, OSError, ValueError, RuntimeError):
            unread.add(int(m.group(1)))
            continue
        if isinstance(dense, dict) and isinstance(dense.get("dir"), str):
            named.add(dense["dir"])
    return named, unread


def remove_unnamed_dense(ckpt_dir: str | Path) -> tuple[int, int]:
    """Remove the dense directories (`dense-<step>-<id>`) no commit point names: a kill
    between a dense directory's rename and its commit point, or a checkpoint no longer kept.
    Returns (directories removed, bytes freed)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return 0, 0
    named, unread = dense_dirs_named(ckpt_dir)
    count = freed = 0
    for m in map(DENSE_DIR.fullmatch, os.listdir(ckpt_dir)):
        path = ckpt_dir / m.group(0) if m else None
        if path is None or m.group(0) in named or int(m.group(1)) in unread \
                or path.is_symlink() or not path.is_dir():
            continue
        freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        count += 1
    return count, freed


def _is_temp(name: str) -> bool:
    return is_temp_name(name) or _SAFETENSORS_TMP.fullmatch(name) is not None


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, state) of one checkpoint; CheckpointError if it fails verification."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable (truncated or "
                              f"corrupted): {str(err).splitlines()[0]}") from None
    if meta.get("format") != "moescale/1" or "state" not in meta or "sha256" not in meta:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a moescale checkpoint "
                              "(metadata missing)")
    if _digest(meta["state"], tensors) != meta["sha256"]:
        raise CheckpointError(f"checkpoint {str(path)!r} failed its checksum (corrupted); "
                              "it is left in place and not used")
    found = nonfinite(tensors)
    if found is not None:    # written before the step guard existed: a diverged run's state
        raise NonFiniteError(f"checkpoint {str(path)!r} holds non-finite values ({found[0]}: "
                             f"{found[1]:,} NaN or Inf, a diverged run's state); it is left "
                             "in place and not used")
    return tensors, json.loads(meta["state"])


def verified_checkpoints(ckpt_dir: str | Path, warn=print):
    """(path, tensors, state) of each checkpoint that verifies, newest first. Bad ones are
    reported through `warn` and skipped; ValueError if none verifies."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise ValueError(f"no checkpoint in {str(ckpt_dir)!r}; nothing to resume (train first, "
                         "or start a new run without --resume)")
    errors = []
    for _, path in reversed(found):
        try:
            tensors, state = load_checkpoint(path)
        except CheckpointError as err:
            errors.append(str(err))
            warn(f"warning: {err}; trying the previous checkpoint")
            continue
        yield path, tensors, state
    raise CheckpointError("; ".join(errors) + "; no usable checkpoint left to resume from")


def load_latest(ckpt_dir: str | Path, warn=print):
    """The newest checkpoint that verifies: (path, tensors, state); see verified_checkpoints."""
    return next(iter(verified_checkpoints(ckpt_dir, warn)))


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state_dict as (tensors named optim.<param>.<key>, JSON-able rest)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{pid}.{key}"] = value
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_flat(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                        rest: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    for name, value in rest["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = []
    for g in rest["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
