"""Atomic, verified checkpoints of an ExpertStore: fp32 masters, gradient accumulators, Adam
moments and step counts of every expert, on either tier.

Layout under the checkpoint directory (format "moescale-store/2"):

    expert-store-{tag}/manifest.json                 layouts, expert counts, and per expert:
                                                     step count, whether its gradient row is
                                                     kept, the xxh3-64 of every chunk of every
                                                     row, its origin (the run's identity)
    expert-store-{tag}/layer{l:03d}/expert{e:05d}.bin  the disk tier's record file format: rows
                                                     MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, each
                                                     padded to align_up(4 P) bytes
    expert-store.LATEST                              the name of the last complete store

The manifest carries the sha256 of its own body, so an edited step count is refused.

Saving a disk-tier store hard-links its current record files (the store freezes them: its next
write of an expert goes to a new file), so a checkpoint of a store larger than RAM or than the
free disk costs no copy; on another filesystem, and for the host tier, records are written one
expert at a time. A save writes `expert-store-{tag}.tmp/`, fsyncs, renames it into place, then
replaces LATEST atomically and only then removes older stores; a failure removes the partial
directory and leaves LATEST and the checkpoint it names intact.

Loading verifies before it changes anything: LATEST must name a store directory beside it (no
path, no other run), the manifest its digest, every file of the experts to load its sums. Any
mismatch raises `StoreCheckpointError` (a ValueError) naming the file and calling it corrupt,
so the caller can fall back to an older checkpoint. A disk-tier store then adopts the verified
files by hard link (no copy), other stores read them, and a disk-tier store checks its reads
against the manifest's sums from the first one on. An expert-parallel rank loads its slice
(`first_expert` of `total_experts` per layer) of a store written for all experts.

Another run's checkpoint is not loaded silently: every expert's entry records the origin of the
store that saved it (store.py: the xxh3-64 of the fp32 master it was built with, so another
seed, model or `expert_init` differs), and a store built with origins refuses, with
`OtherRunError` naming the experts and the two origins, a checkpoint whose origins differ, or
one that records none (an older moescale's) unless `tag` names it; `allow_other_run=True` loads
it anyway (fine-tuning from another run). A blank store (masters left unwritten for a loader)
takes the checkpoint's origins.

Checkpoints of the first format (`meta.json` and one file per layer, unverifiable) still load,
with a warning.

Deliberately not here: dense parameters and the dense optimizer (the trainer's own checkpoint),
the gathering over ranks (moescale/train/run_state.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings

import torch

from moescale.atomic import atomic_write_text, publish_dir
from moescale.offload import disk_links
from moescale.offload.direct_io import (CHUNK_BYTES, CorruptReadError, DirectIO, SlotPool,
                                       align_up, chunk_sums)
from moescale.offload.records import (POS_EXP_AVG, POS_EXP_AVG_SQ, POS_GRAD, POS_MASTER, STATE,
                                      G, rows_of)
from moescale.offload.state_format import RecordGeometry, StateCodec, StateFormat, format_of
from moescale.offload.store import LOGICAL_POS, ExpertStore

LATEST = "expert-store.LATEST"
FORMAT = "moescale-store/2"
_NAME = re.compile(r"expert-store-[A-Za-z0-9_.-]+")


class StoreCheckpointError(ValueError):
    """An expert-store checkpoint that is missing, corrupt, or not this model's."""


class OtherRunError(StoreCheckpointError):
    """A complete checkpoint of another run (its experts started from other weights)."""


def _record_path(root: str, key) -> str:
    return os.path.join(root, f"layer{key[0]:03d}", f"expert{key[1]:05d}.bin")


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------- saving
def save_store(store: ExpertStore, directory: str, tag: str) -> str:
    """Write the whole store under directory (atomically); returns the store directory."""
    if store.disk is not None:   # the records as they are, in the store's format
        return _publish(directory, tag, store.layouts, store.num_experts,
                        lambda tmp: _link_disk_store(store, tmp), store.format)
    return save_records(directory, tag, store.layouts, store.num_experts,
                        lambda layer, e: store.read_record((layer, e)),
                        lambda layer, e: store.origins.get((layer, e)))


def save_records(directory: str, tag: str, layouts, num_experts: list[int], read,
                 origin_of=None) -> str:
    """save_store's format from any source: read(layer, e) -> (record [4, P] fp32 in store
    row order, step count), called in file order (expert-parallel runs write their gathered
    shards with it); origin_of(layer, e): the expert's origin (None: not recorded)."""
    def write(tmp: str) -> dict:
        entries = {}
        for layer, num in enumerate(num_experts):
            for e in range(num):
                data_4P, step = read(layer, e)
                entries[f"{layer},{e}"] = dict(step=float(step), grad=True, sums=_write_record(
                    _record_path(tmp, (layer, e)), data_4P),
                    origin=origin_of(layer, e) if origin_of else None)
        return entries
    return _publish(directory, tag, layouts, num_experts, write)


def _write_record(path: str, data_4P: torch.Tensor) -> dict:
    """One record file (buffered, fsynced) from a [4, P] record; its sums by row position."""
    numel = data_4P.shape[1]
    stride = align_up(4 * numel)
    row_u8 = torch.zeros(stride, dtype=torch.uint8)
    sums = {}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for pos in range(4):
            row_u8[:4 * numel].view(torch.float32).copy_(data_4P[LOGICAL_POS.index(pos)])
            f.write(memoryview(row_u8.numpy()))
            sums[str(pos)] = chunk_sums(row_u8, CHUNK_BYTES)
        f.flush()
        os.fsync(f.fileno())
    return sums


def _link_disk_store(store: ExpertStore, tmp: str) -> dict:
    """Hard-link a disk-tier store's files into tmp (see link_disk_store)."""
    return {f"{key[0]},{key[1]}": dict(info, origin=store.origins.get(key)) for key, info in
            link_disk_store(store, lambda key: _record_path(tmp, key)).items()}


def link_disk_store(store: ExpertStore, dest_of) -> dict:
    """Hard-link every file of a disk-tier store (flushed first) to dest_of(key), a path (None:
    not saved); across filesystems, copy them, checking each against the sums the store wrote
    (a file damaged under the store fails the save). Freezes the files (the store's next write
    of an expert goes to a new file). Returns {key: {step, grad, sums {"pos": chunk sums}}} of
    the keys saved (expert shards link a rank's records under global names with it)."""
    copies = []

    def link(path: str, key) -> None:
        dest = dest_of(key)
        if dest is None:
            return
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if not copies:
            try:
                os.link(path, dest)
                return
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
        copies.append((path, dest, key))   # another filesystem: copied below, unlocked

    snap = disk_links.snapshot(store.disk, link)
    if copies:
        chunk = store.disk.io.chunk_bytes
        buf = SlotPool(1, max(store.disk.record_bytes(k[0]) for _, _, k in copies))
        try:
            for path, dest, key in copies:
                geo = store.disk.geometries[key[0]]
                record_u8 = buf.slots[0][:geo.total]
                store.disk.io.read(path, 0, record_u8).result()
                for pos, sums in snap[key]["sums"].items():
                    if chunk_sums(record_u8[geo.offsets[pos]:geo.offsets[pos + 1]],
                                  chunk) != sums:
                        raise OSError(errno.EIO, f"the store file {path!r} does not match what "
                                      "the store wrote (damaged on disk)")
                with open(dest, "wb") as f:
                    f.write(memoryview(record_u8.numpy()))
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            buf.close()
    return {key: dict(step=store.step_of(key), grad=info["grad"],
                      sums={str(p): c for p, c in info["sums"].items()})
            for key, info in snap.items() if dest_of(key) is not None}


def _publish(directory: str, tag: str, layouts, num_experts, write,
             fmt: StateFormat = StateFormat()) -> str:
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory={directory!r} does not exist; create it first")
    name = f"expert-store-{tag}"
    for k in range(1, 1 << 20):   # never overwrite a directory LATEST may name
        if not os.path.exists(os.path.join(directory, name)):
            break
        name = f"expert-store-{tag}.{k}"
    final, tmp = os.path.join(directory, name), os.path.join(directory, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        body = dict(format=FORMAT, checksum="xxh3_64", chunk_bytes=CHUNK_BYTES,
                    layouts=[[[n, list(s)] for n, s in zip(lay.names, lay.shapes)]
                             for lay in layouts],
                    num_experts=list(num_experts), experts=write(tmp))
        if not fmt.exact:     # fp32 manifests stay as every earlier version wrote them
            body["state"] = dict(master=fmt.master, moments=fmt.moments)
        atomic_write_text(os.path.join(tmp, "manifest.json"),
                          json.dumps(dict(body=body, sha256=_digest(body))))
        publish_dir(tmp, final)
        atomic_write_text(os.path.join(directory, LATEST), name)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, CorruptReadError):   # a damaged store file, not a full disk
            raise
        raise OSError(err.errno, f"could not write the expert-store checkpoint under "
                      f"{directory!r} ({err.strerror or err}); the previous checkpoint is intact "
                      "(free disk space or choose another directory, then save again)") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for entry in os.listdir(directory):
        if entry.startswith("expert-store-") and entry != name and \
                os.path.isdir(os.path.join(directory, entry)):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    return final


# ---------------------------------------------------------------------------- loading
def _latest(directory: str, tag: str | None = None) -> str:
    latest = os.path.join(directory, LATEST)
    try:
        with open(latest) as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise StoreCheckpointError(f"no expert-store checkpoint under {directory!r} ({LATEST} "
                                   "is missing)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise StoreCheckpointError(f"{latest!r} cannot be read ({err}); the checkpoint is "
                                   "corrupt") from err
    if not _NAME.fullmatch(name) or not os.path.isdir(os.path.join(directory, name)):
        raise StoreCheckpointError(f"{latest!r} names {name[:200]!r}, which is not a store "
                                   f"directory beside it; the checkpoint is corrupt (or was "
                                   "edited): resume from another checkpoint")
    if tag is not None and not re.fullmatch(rf"expert-store-{re.escape(tag)}(\.\d+)?", name):
        raise StoreCheckpointError(f"{latest!r} names {name!r}, not the store saved with this "
                                   f"checkpoint (tag {tag!r}); the checkpoint is corrupt (or was "
                                   "edited): resume from another checkpoint")
    return os.path.join(directory, name)


def load_store(store: ExpertStore, directory: str, first_expert: int = 0,
               total_experts: int | None = None, tag: str | None = None,
               allow_other_run: bool = False) -> None:
    """Fill `store` (same layers and experts) from the checkpoint LATEST names, after
    verifying it (and, given `tag`, that it is the store saved with that tag) and that it is
    this run's (the origins; `allow_other_run`: load another run's anyway). Expert-parallel
    shard: the checkpoint holds `total_experts` per layer and the store the
    `store.num_experts` starting at `first_expert` (global ids)."""
    src = _latest(directory, tag)
    if not os.path.exists(os.path.join(src, "manifest.json")) and \
            os.path.exists(os.path.join(src, "meta.json")):
        _load_v1(store, src, first_expert, total_experts)
        return
    body = _read_manifest(src)
    want = [[[n, list(s)] for n, s in zip(lay.names, lay.shapes)] for lay in store.layouts]
    expected = store.num_experts if total_experts is None else \
        [total_experts] * len(store.num_experts)
    if body["layouts"] != want or body["num_experts"] != expected:
        raise StoreCheckpointError(
            f"the checkpoint in {src!r} holds experts of another shape ({body['num_experts']} "
            f"experts per layer, this model {expected}); build the same model")
    keys = [(layer, e) for layer, n in enumerate(store.num_experts) for e in range(n)]
    infos = {}
    for key in keys:
        name = f"{key[0]},{first_expert + key[1]}"
        info = body["experts"].get(name)
        if not isinstance(info, dict):
            raise StoreCheckpointError(f"the manifest in {src!r} lacks expert {name}; the "
                                       "checkpoint is corrupt")
        infos[key] = info
    try:
        saved = format_of(body)
    except ValueError as err:
        raise StoreCheckpointError(f"the manifest in {src!r} names no record format ({err}); "
                                   "the checkpoint is corrupt") from None
    if not allow_other_run:
        _check_origins(store, src, keys, infos, first_expert, tag)
    _verify(store, src, keys, infos, first_expert, body["chunk_bytes"], saved)
    if store.disk is not None and _same_fs(src, store.config.directory) and \
            saved.name == store.format.name and body["chunk_bytes"] == store.disk.io.chunk_bytes:
        store.disk.flush(drop=True)
        for key in keys:
            info = infos[key]
            disk_links.adopt(store.disk, key,
                             _record_path(src, (key[0], first_expert + key[1])),
                             {int(p): c for p, c in info["sums"].items()}, info["grad"])
            _set_step(store, key, info["step"])
    else:
        for key in keys:   # copy the verified files into the store (decoded: another format)
            _copy_in(store, key, _record_path(src, (key[0], first_expert + key[1])),
                     infos[key], saved)
    for key in keys:     # a blank store becomes the checkpoint's run
        if store.origins.get(key) is None:
            store.origins[key] = infos[key].get("origin")


def _check_origins(store, src, keys, infos, first_expert, tag) -> None:
    """Refuse another run's checkpoint (see the module docstring): an expert whose recorded
    origin differs from the store's, or none recorded and no `tag` naming the checkpoint."""
    mine = {k: store.origins.get(k) for k in keys if store.origins.get(k) is not None}
    theirs = {k: infos[k].get("origin") for k in mine}
    other = [k for k in mine if theirs[k] is not None and theirs[k] != mine[k]]
    override = "or pass allow_other_run=True to load it anyway (e.g. to fine-tune from it)"
    if other:
        layer, e = other[0]
        raise OtherRunError(
            f"the checkpoint in {src!r} belongs to another run: {len(other)} of {len(keys)} "
            f"experts started from other weights than this store's (layer {layer} expert "
            f"{first_expert + e}: origin {theirs[other[0]]} in the checkpoint, {mine[other[0]]} "
            "here: another seed, model or expert_init); build the store as that run did, "
            f"{override}")
    if tag is None and any(theirs[k] is None for k in mine):
        raise OtherRunError(
            f"the checkpoint in {src!r} records no origin of its experts (an older moescale's), "
            "so it cannot be told from another run's: name it with tag=<the tag it was saved "
            f"with>, {override}")


def _read_manifest(src: str) -> dict:
    path = os.path.join(src, "manifest.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        body = doc["body"]
        ok = doc.get("sha256") == _digest(body) and body.get("format") == FORMAT and \
            body.get("checksum") == "xxh3_64"
    except FileNotFoundError:
        raise StoreCheckpointError(f"{path!r} is missing; the checkpoint is incomplete or "
                                   "corrupt") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreCheckpointError(f"{path!r} cannot be read ({err}); the checkpoint is "
                                   "corrupt") from err
    if not ok:
        raise StoreCheckpointError(f"{path!r} does not match its digest (edited or corrupt); "
                                   "the checkpoint is corrupt: resume from another one")
    return body


def _verify(store, src, keys, infos, first_expert, chunk, saved: StateFormat) -> None:
    """Read every file of `keys` and compare its sums (direct I/O, no page cache)."""
    io = DirectIO(threads=2, chunk_bytes=chunk)
    biggest = max(max(RecordGeometry(saved, store.layouts[k[0]].numel).strides)
                  for k in keys) if keys else 4096
    buf = SlotPool(1, biggest)
    try:
        for key in keys:
            path = _record_path(src, (key[0], first_expert + key[1]))
            geo = RecordGeometry(saved, store.layouts[key[0]].numel)
            sums = infos[key]["sums"]
            rows = STATE | (G if infos[key]["grad"] else 0)
            for pos in rows_of(rows):
                row_u8 = buf.slots[0][:geo.strides[pos]]
                try:
                    io.read(path, geo.offsets[pos], row_u8).result()
                except OSError as err:
                    raise StoreCheckpointError(f"expert file {path!r} cannot be read "
                                               f"({err.strerror or err}); the checkpoint is "
                                               "corrupt or incomplete") from err
                if chunk_sums(row_u8, chunk) != sums.get(str(pos)):
                    raise StoreCheckpointError(f"expert file {path!r} does not match its "
                                               "checksum; the checkpoint is corrupt")
    finally:
        io.close()
        buf.close()


def _same_fs(a: str, b: str) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def _set_step(store: ExpertStore, key, step: float) -> None:
    store.set_step(key, step)
    store.bump_version(key)   # device copies of the old state are stale


def _copy_in(store: ExpertStore, key, path: str, info: dict, saved: StateFormat) -> None:
    numel = store.layouts[key[0]].numel
    geo = RecordGeometry(saved, numel)
    raw = torch.from_file(path, size=geo.total, dtype=torch.uint8)
    if not (saved.exact and store.format.exact):
        codec = StateCodec(saved)
        store.put_state(key, codec.decode_master(geo.typed(raw, POS_MASTER), numel,
                                                 torch.empty(numel)),
                        *[codec.decode_moment(geo.typed(raw, pos), numel, signed, "m",
                                              torch.empty(numel))
                          for pos, signed in ((POS_EXP_AVG, True), (POS_EXP_AVG_SQ, False))])
        if info["grad"]:
            rec = store.acquire(key, G)
            try:
                rec.grad_P.copy_(geo.typed(raw, POS_GRAD))
            finally:
                store.release(key, dirty=True, rows=G)
        _set_step(store, key, info["step"])
        return
    stride = align_up(4 * numel)
    rec = store.acquire(key)
    try:
        for logical, pos in enumerate(LOGICAL_POS):
            if pos == POS_GRAD and not info["grad"]:
                rec.rows[logical].zero_()
            else:
                rec.rows[logical].copy_(raw[pos * stride:pos * stride + 4 * numel]
                                        .view(torch.float32))
        _set_step(store, key, info["step"])
    finally:
        store.release(key, dirty=True)


def _load_v1(store: ExpertStore, src: str, first_expert: int, total_experts) -> None:
    """The first format: meta.json + layer{l}.bin of [E, 4, P] (no checksums)."""
    warnings.warn(f"{src!r} is an expert-store checkpoint of the first format, which has no "
                  "checksums: it is loaded unverified", RuntimeWarning, stacklevel=3)
    with open(os.path.join(src, "meta.json")) as f:
        meta = json.load(f)
    want = [[[n, list(s)] for n, s in zip(lay.names, lay.shapes)] for lay in store.layouts]
    expected = store.num_experts if total_experts is None else \
        [total_experts] * len(store.num_experts)
    got = [[[n, list(s)] for n, s in layer] for layer in meta["layouts"]]
    if got != want or meta["num_experts"] != expected:
        raise StoreCheckpointError(f"the checkpoint in {src!r} holds experts of another shape "
                                   f"({meta['num_experts']} experts per layer, this model "
                                   f"{expected}); build the same model")
    for layer, num in enumerate(store.num_experts):
        numel = store.layouts[layer].numel
        with open(os.path.join(src, f"layer{layer:03d}.bin"), "rb") as f:
            f.seek(first_expert * 16 * numel)
            for e in range(num):
                buf = torch.empty(4, numel, dtype=torch.float32)
                if f.readinto(memoryview(buf.numpy()).cast("B")) != 16 * numel:
                    raise StoreCheckpointError(f"checkpoint file layer{layer:03d}.bin in "
                                               f"{src!r} is truncated")
                rec = store.acquire((layer, e))
                try:
                    for row, t in zip(rec.rows, buf):
                        row.copy_(t)
                    _set_step(store, (layer, e), meta["steps"][f"{layer},{first_expert + e}"])
                finally:
                    store.release((layer, e), dirty=True)
