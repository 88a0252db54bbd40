"""The dense half of a checkpoint through torch.distributed.checkpoint (DCP), written durably.

    entry = save_dense(tensors, ckpt_dir, step, ranks)      # collective: every rank its part
    verify_dense(ckpt_dir, entry, ranks)                    # collective: CheckpointError if bad
    load_dense(ckpt_dir, entry, targets)                    # fills `targets` (any sharding)
    full = consolidated(ckpt_dir, entry)                    # every tensor whole, one process

`tensors` is a flat dict of the dense state (`model.<name>`, `optim.<name>.<key>`): plain
tensors when the dense parameters are replicated or on one process, DTensors when they are
sharded (FSDP2's `fully_shard`); DCP writes each tensor once (a replicated one by one rank, a
sharded one shard by shard, every rank its own file `__<rank>_0.distcp`) and reads it back into
whatever layout the loading run has, so a checkpoint resumes at another world size and another
sharding. No process group is needed: one process writes and reads the same format.

Durability (docs/reliability.md): every rank writes into `checkpoints/dense-<step>-<id>.tmp/`
(DCP fsyncs its files); each rank hashes the files it wrote (xxh3-128, as the expert store
hashes its records: 144 MiB in 9.5 ms here, sha256 155 ms), rank 0 gathers the sums, checks
that DCP's `.metadata` reads back and names only files that are there, writes `manifest.json`
(every file's size and xxh3-128) and renames the directory to `dense-<step>-<id>`
(publish_dir: fsynced). Only then does the caller write the commit point (the run's
`ckpt_<step>.safetensors`, which records the directory and the manifest's sha256). A kill
before the rename leaves a `*.tmp` directory, one after it and before the commit a directory
no commit names: the next start removes both (checkpoint.remove_unnamed_dense, from
sweep_temp_files and after each save). `<id>` is new for every save, so a save never writes
over a directory a commit point names. Loading checks the manifest against the commit's sum
and every file against the manifest (the ranks share the files out) before anything is read
into the model; a damaged, truncated or missing file is a CheckpointError naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import xxhash
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moescale.atomic import atomic_write_text, publish_dir
from moescale.train.checkpoint import DENSE_DIR, CheckpointError

DENSE_PREFIX = "dense-"
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def dense_dir_name(step: int, nonce: str) -> str:
    return f"{DENSE_PREFIX}{step:08d}-{nonce}"


def _file_sum(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _no_dist() -> bool:
    """No process group: DCP reads and writes as one process."""
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _one_process_quiet():
    """DCP warns on every call without a process group; one process is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _gather(ranks, value) -> list:
    return [value] if ranks is None else ranks.gather_objects(value)


def save_dense(tensors: dict[str, torch.Tensor], ckpt_dir: str | Path, step: int,
               ranks) -> dict:
    """Collective (every rank of `ranks`, None: one process): write `tensors` as the DCP
    directory of step `step` (module docstring); returns the commit point's entry
    {"dir", "manifest_sha256"} on every rank. A failure on any rank (disk full, read-only)
    raises OSError on every rank; the temp directory is removed and the checkpoints already
    written stay as they are (a kill leaves it to the next start's sweep)."""
    ckpt_dir = Path(ckpt_dir)
    rank = 0 if ranks is None else ranks.rank
    nonce = os.urandom(4).hex()
    name = dense_dir_name(step, nonce if ranks is None else ranks.agree(nonce))
    tmp = ckpt_dir / f"{name}.tmp"
    try:
        _write(tensors, tmp, rank, ranks)
        entry = _publish(tmp, ckpt_dir / name, step, rank, ranks)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def _agree_ok(ranks, error: BaseException | None) -> None:
    """Every rank raises when one failed: its own error, or an OSError naming the failure."""
    errors = [e for e in _gather(ranks, None if error is None else str(error)) if e]
    if error is not None:
        raise error
    if errors:
        raise OSError(None, f"another rank failed ({errors[0][:200]})")


def _write(tensors, tmp: Path, rank: int, ranks) -> None:
    """Every rank writes its part into `tmp` (DCP fsyncs each file)."""
    error = None
    if rank == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as err:
            error = err
    _agree_ok(ranks, error)
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    try:
        with _one_process_quiet():
            dcp.save(tensors, storage_writer=writer, no_dist=_no_dist())
    except CheckpointException as err:      # a rank's I/O error, on every rank
        raise _as_os_error(err, tmp) from None


def _publish(tmp: Path, final: Path, step: int, rank: int, ranks) -> dict:
    """Hash every rank's files, check and write the manifest, rename into place (rank 0)."""
    mine, error = {}, None
    try:
        mine = {p.name: [p.stat().st_size, _file_sum(p)] for p in sorted(tmp.iterdir())
                if p.name.startswith(f"__{rank}_")}
    except OSError as err:
        error = err
    parts = _gather(ranks, mine)
    _agree_ok(ranks, error)
    entry = error = None
    if rank == 0:
        try:
            files = {name: value for part in parts for name, value in part.items()}
            meta = tmp / ".metadata"
            files[".metadata"] = [meta.stat().st_size, _file_sum(meta)]
            _check_metadata(tmp, files)
            text = json.dumps({"step": step, "files": files}, sort_keys=True, indent=1)
            atomic_write_text(tmp / MANIFEST, text)
            publish_dir(tmp, final)
            entry = {"dir": final.name,
                     "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}
        except (OSError, CheckpointError) as err:
            error = err if isinstance(err, OSError) else OSError(None, str(err))
    _agree_ok(ranks, error)
    return entry if ranks is None else ranks.agree(entry)


def _as_os_error(err: CheckpointException, where: Path) -> OSError:
    """DCP's CheckpointException holds each failed rank's exception: the first OSError as it
    is (its errno says disk full or read-only), else one naming the directory."""
    for failure in err.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return OSError(None, f"the dense checkpoint could not be written ({str(err)[:200]})",
                   str(where))


def _check_metadata(folder: Path, files: dict) -> None:
    """DCP's metadata reads back and every file it names is in `files` (else CheckpointError)."""
    try:
        meta = FileSystemReader(folder).read_metadata()
    except Exception as err:    # noqa: BLE001 -- unpickling garbage raises anything
        raise CheckpointError(f"dense checkpoint {str(folder / '.metadata')!r} is unreadable "
                              f"(truncated or corrupted): {str(err).splitlines()[0][:200]}") \
            from None
    named = {item.relative_path for item in (meta.storage_data or {}).values()}
    absent = sorted(named - set(files))
    if absent:
        raise CheckpointError(f"dense checkpoint {str(folder)!r} is incomplete: its metadata "
                              f"names {absent[:3]}, which are missing")
    return meta


def _dir_of(ckpt_dir: Path, entry) -> Path:
    name = entry.get("dir") if isinstance(entry, dict) else None
    if not isinstance(name, str) or DENSE_DIR.fullmatch(name) is None:
        raise CheckpointError(f"a checkpoint in {str(ckpt_dir)!r} names the dense directory "
                              f"{str(name)[:100]!r}, which is not one of ours; it is not used")
    return ckpt_dir / name


def verify_dense(ckpt_dir: str | Path, entry: dict, ranks=None) -> None:
    """Collective: CheckpointError (on every rank, naming the file) unless the manifest
    matches the commit point's sum and every file its manifest entry; the ranks share the
    files out (rank r hashes every world-th one)."""
    folder = _dir_of(Path(ckpt_dir), entry)
    manifest = folder / MANIFEST
    error = None
    try:
        text = manifest.read_bytes()
        if hashlib.sha256(text).hexdigest() != entry.get("manifest_sha256"):
            raise CheckpointError(f"dense checkpoint manifest {str(manifest)!r} failed its "
                                  "checksum (corrupted); it is left in place and not used")
        files = json.loads(text)["files"]
        rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world_size)
        for name in sorted(files)[rank::world]:
            size, digest = files[name]
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"dense checkpoint file {str(path)!r} is missing; the "
                                      "checkpoint is incomplete and not used")
            if path.stat().st_size != size or _file_sum(path) != digest:
                raise CheckpointError(f"dense checkpoint file {str(path)!r} failed its "
                                      "checksum (truncated or corrupted); it is left in place "
                                      "and not used")
        if rank == 0:
            _check_metadata(folder, files)
    except FileNotFoundError:
        error = (f"dense checkpoint {str(folder)!r} is missing or has no {MANIFEST}; the "
                 "checkpoint is incomplete and not used")
    except CheckpointError as err:
        error = str(err)
    errors = [e for e in _gather(ranks, error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])


def dense_metadata(ckpt_dir: str | Path, entry: dict) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(global shape, dtype) of every tensor the dense checkpoint holds, by name."""
    meta = FileSystemReader(_dir_of(Path(ckpt_dir), entry)).read_metadata()
    return {k: (v.size, v.properties.dtype) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def load_dense(ckpt_dir: str | Path, entry: dict, targets: dict[str, torch.Tensor]) -> None:
    """Read the checkpoint's tensors into `targets` in place (plain tensors whole, DTensors
    their local shards); collective when a process group exists. Verify first."""
    folder = _dir_of(Path(ckpt_dir), entry)
    try:
        with _one_process_quiet():
            dcp.load(targets, storage_reader=FileSystemReader(folder), no_dist=_no_dist())
    except CheckpointException as err:
        first = next(iter(err.failures.values()), (err, None))[0]
        raise CheckpointError(f"dense checkpoint {str(folder)!r} could not be read into this "
                              f"model ({str(first).splitlines()[0][:200]})") from None


def consolidated(ckpt_dir: str | Path, entry: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a dense checkpoint whose name starts with `prefix` ("model.": the
    weights only), whole, in this process (no process group needed): DCP reads each from
    whichever ranks' files hold its pieces. Verify first."""
    shapes = dense_metadata(ckpt_dir, entry)
    full = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()
            if name.startswith(prefix)}
    with _one_process_quiet():
        dcp.load(full, storage_reader=FileSystemReader(_dir_of(Path(ckpt_dir), entry)),
                 no_dist=True)
    return full
