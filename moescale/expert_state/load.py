"""load_expert_shards: each rank reads only the experts it holds now, from any writer layout.

1. Locate: the manifest entries of every writer rank say which global experts of which layer
   each shard holds; every expert held here must be in exactly one of them.
2. Indexes: each needed shard's index, checked against the sha256 its entry recorded; the
   layer's expert count and tensor shapes must be this model's.
3. Verify: every needed tensor's xxh3-64 (safetensors) or every chunk sum of a record's master
   and moment rows (disk-tier records, read by direct I/O through one reused aligned buffer),
   before anything changes (`masters_only`, for generation: the master rows alone): a
   corrupt or missing shard raises `ShardCheckpointError` (a StoreCheckpointError) naming the
   file, and the model, optimizer and stores are untouched.
4. Write: offload engines are synchronized and their device caches cleared; then per expert
   the resident parameters and the optimizer's AdamW state, or the store record (master,
   moments, step; the gradient accumulator zeroed). A disk-tier store on the same filesystem
   adopts a verified record file by hard link (no copy: nothing of the expert passes through
   memory); other targets read the tensors one at a time (checked again as they are read).

Peak memory beyond the destination: one aligned record buffer (disk-tier sources) and one
tensor at a time (safetensors sources; read by pread, the file is never mapped).

Not here: the dense half and the commit point (the caller's); any collective (each rank reads
for itself; a caller whose ranks share a store barriers before anyone computes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import xxhash

from moescale.expert_state.holdings import HeldLayer, held_layers
from moescale.expert_state.index import (TENSOR_FILE, ShardCheckpointError, check_entry,
                                         file_path, layout_of, read_index, tensor_name)
from moescale.expert_state.save import selected
from moescale.expert_state.tensorfile import TensorFile
from moescale.offload import disk_links
from moescale.offload.direct_io import DirectIO, SlotPool, align_up, chunk_sums
from moescale.offload.records import POS_EXP_AVG, POS_EXP_AVG_SQ, POS_GRAD, POS_MASTER
from moescale.offload.state_format import RecordGeometry, StateCodec, format_of
from moescale.offload.store import ExpertLayout


def _locate(manifests) -> dict[tuple[str, int], dict]:
    if isinstance(manifests, dict):
        manifests = [manifests]
    where: dict[tuple[str, int], dict] = {}
    for entry in manifests:
        check_entry(entry)
        for key, runs in entry["experts"].items():
            for first, stop in runs:
                for e in range(first, stop):
                    other = where.setdefault((key, e), entry)
                    if other is not entry:
                        raise ShardCheckpointError(
                            f"expert {e} of {key!r} is in two shards ({other['path']!r} and "
                            f"{entry['path']!r}); give the entries of one checkpoint, saved by "
                            "the ranks of one replica")
    return where


class _Job:
    """One expert to load: where it is held here and where it lies in the checkpoint."""

    def __init__(self, layer: HeldLayer, l: int, entry: dict, info: dict, path: str) -> None:
        self.layer, self.l, self.entry, self.info, self.path = layer, l, entry, info, path
        self.e = layer.expert_ids[l]
        self.record = info["file"] != TENSOR_FILE
        self.geometry: RecordGeometry | None = None     # a record file's rows (set by _jobs)

    def where(self) -> str:
        return f"expert {self.e} of {self.layer.key!r} in {self.path!r}"


class _FileTensors(Mapping):
    """One part (master or a moment) of an expert in a safetensors shard, read on access and
    checked against its sum."""

    def __init__(self, job: _Job, file: TensorFile, part: str) -> None:
        self.job, self.file, self.part = job, file, part
        self.names = [n for n, _ in job.layer.spec]

    def __getitem__(self, name: str) -> torch.Tensor:
        job = self.job
        t = self.file.read(tensor_name(job.layer.key, job.e, self.part, name))
        if xxhash.xxh3_64_hexdigest(memoryview(t.view(-1).view(torch.uint8).numpy())) != \
                job.info["sums"].get(f"{self.part}/{name}"):
            raise ShardCheckpointError(f"{job.where()}: tensor {self.part}/{name} does not "
                                       "match its checksum; the checkpoint is corrupt")
        return t

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _Reader:
    """Open shard files and one aligned record buffer, shared by every job."""

    def __init__(self, jobs: list[_Job], chunk_bytes: int, masters_only: bool = False) -> None:
        self.files: dict[str, TensorFile] = {}
        self.masters_only = masters_only
        sizes = [j.geometry.offsets[POS_EXP_AVG if masters_only else POS_GRAD]
                 for j in jobs if j.record]
        self.io = DirectIO(threads=2, chunk_bytes=chunk_bytes) if sizes else None
        self.pool = SlotPool(1, max(sizes)) if sizes else None
        self.chunk = chunk_bytes

    def tensors(self, job: _Job) -> TensorFile:
        file = self.files.get(job.path)
        if file is None:
            try:
                file = self.files[job.path] = TensorFile(job.path)
            except OSError as err:
                raise ShardCheckpointError(f"expert shard file {job.path!r} cannot be read "
                                           f"({err}); the checkpoint is incomplete or "
                                           "corrupt") from err
        return file

    def record(self, job: _Job) -> torch.Tensor:
        """The master and moment rows of a record file, read and checked (uint8; masters_only:
        the master row)."""
        geo = job.geometry
        positions = (POS_MASTER,) if self.masters_only else \
            (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ)
        rows_u8 = self.pool.slots[0][:geo.offsets[positions[-1] + 1]]
        try:
            self.io.read(job.path, 0, rows_u8).result()
        except OSError as err:
            raise ShardCheckpointError(f"{job.where()} cannot be read ({err.strerror or err}); "
                                       "the checkpoint is incomplete or corrupt") from err
        for pos in positions:
            if chunk_sums(rows_u8[geo.offsets[pos]:geo.offsets[pos + 1]], self.chunk) != \
                    job.info["sums"].get(str(pos)):
                raise ShardCheckpointError(f"{job.where()} does not match its checksum; the "
                                           "checkpoint is corrupt")
        return rows_u8

    def verify(self, job: _Job) -> None:
        if job.record:
            self.record(job)
            return
        file = self.tensors(job)
        moments = job.info.get("moments") and not self.masters_only
        parts = ["master"] + (["exp_avg", "exp_avg_sq"] if moments else [])
        for part in parts:
            for name, _ in job.layer.spec:
                try:
                    got = file.digest(tensor_name(job.layer.key, job.e, part, name))
                except OSError as err:
                    raise ShardCheckpointError(f"{job.where()}: {err}; the checkpoint is "
                                               "corrupt") from err
                if got != job.info["sums"].get(f"{part}/{name}"):
                    raise ShardCheckpointError(f"{job.where()}: tensor {part}/{name} does not "
                                               "match its checksum; the checkpoint is corrupt")

    def source(self, job: _Job):
        """(master, moments or None) of the job's expert, as mappings name -> tensor."""
        step = job.info.get("step")
        if job.record:
            rows_u8 = self.record(job)
            layout, geo = ExpertLayout(job.layer.spec), job.geometry
            codec, numel = StateCodec(geo.fmt), layout.numel
            master_P = codec.decode_master(geo.typed(rows_u8, POS_MASTER), numel,
                                           torch.empty(numel) if not geo.fmt.exact else None)
            if self.masters_only:
                return layout.split(master_P), None
            moments = [codec.decode_moment(geo.typed(rows_u8, pos), numel, signed, "m",
                                           torch.empty(numel) if not geo.fmt.exact else None)
                       for pos, signed in ((POS_EXP_AVG, True), (POS_EXP_AVG_SQ, False))]
            return layout.split(master_P), (*map(layout.split, moments), float(step))
        file = self.tensors(job)
        master = _FileTensors(job, file, "master")
        if not job.info.get("moments") or self.masters_only:
            return master, None
        return master, (_FileTensors(job, file, "exp_avg"),
                        _FileTensors(job, file, "exp_avg_sq"), float(step))

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        if self.io is not None:
            self.io.close()
            self.pool.close()


def _jobs(directory: str, layers: list[HeldLayer], picks, where) -> tuple[list[_Job], int]:
    indexes: dict[str, dict] = {}
    jobs, chunk = [], None
    for layer in layers:
        for l in picks[layer.key]:
            e = layer.expert_ids[l]
            entry = where.get((layer.key, e))
            if entry is None:
                raise ShardCheckpointError(f"no shard of the checkpoint holds expert {e} of "
                                           f"{layer.key!r}; it is incomplete or of another "
                                           "model")
            index = indexes.get(entry["path"])
            if index is None:
                index = indexes[entry["path"]] = read_index(directory, entry)
                chunk = index.get("chunk_bytes", chunk)
            saved = index["layers"].get(layer.key) or {}
            if saved.get("num_experts") != layer.num_experts or \
                    saved.get("layout") != layout_of(layer.spec):
                raise ShardCheckpointError(
                    f"the checkpoint's {layer.key!r} holds {saved.get('num_experts')} experts "
                    f"of {saved.get('layout')}, this model {layer.num_experts} of "
                    f"{layout_of(layer.spec)}; build the same model")
            info = saved.get("experts", {}).get(str(e))
            if not isinstance(info, dict) or not isinstance(info.get("sums"), dict):
                raise ShardCheckpointError(f"the index of {entry['path']!r} lacks expert {e} "
                                           f"of {layer.key!r}; the checkpoint is corrupt")
            job = _Job(layer, l, entry, info, file_path(directory, entry, info))
            numel = ExpertLayout(layer.spec).numel
            has_step = isinstance(info.get("step"), (int, float))
            try:
                job.geometry = RecordGeometry(format_of(info), numel)
            except ValueError as err:
                raise ShardCheckpointError(f"{job.where()}: the index's record format is "
                                           f"wrong ({err}); the checkpoint is corrupt") from None
            stride_ok = info.get("stride") == align_up(4 * numel) if job.geometry.fmt.exact \
                else info.get("state_bytes") == job.geometry.offsets[POS_GRAD]
            if (job.record and not stride_ok) or \
                    ((job.record or info.get("moments")) and not has_step):
                raise ShardCheckpointError(f"{job.where()}: the index's row stride "
                                           f"{info.get('stride')} (for {numel} parameters) or "
                                           f"step {info.get('step')!r} is wrong; the "
                                           "checkpoint is corrupt")
            jobs.append(job)
    return jobs, chunk or (8 << 20)


def _adoptable(job: _Job) -> bool:
    access = job.layer.access
    if not job.record or access.store is None or access.tier != "disk" or \
            job.geometry.fmt.name != access.store.format.name:
        return False      # another format: decoded and written in the store's
    return os.stat(job.path).st_dev == os.stat(access.store.config.directory).st_dev


def load_expert_shards(model, directory: str, manifests, *, optimizer=None, engine=None,
                       share: tuple[int, int] | None = None, masters_only: bool = False) -> dict:
    """Load the experts this process holds from the shards `manifests` (every writer rank's
    entry, as save_expert_shards returned them) under `directory`; see the module docstring.
    `optimizer`: receives the resident experts' AdamW state (load the dense optimizer state
    first: torch's load_state_dict replaces all state); `engine`: the OffloadEngine of
    offloaded experts (default: the one they name); `share=(i, n)`: load block i of n of each
    layer's experts (the ranks of a node-shared store split it; barrier before use). Returns
    counts: experts loaded, adopted by hard link, bytes read. `masters_only` (generation: the
    experts will never step): only the master rows are read and verified, the moments load as
    zero (an adopted record file keeps its unverified moment rows, which nothing reads)."""
    layers = held_layers(model, optimizer, engine)
    picks = {layer.key: selected(layer, share) for layer in layers}
    jobs, chunk = _jobs(directory, layers, picks, _locate(manifests))
    reader = _Reader(jobs, chunk, masters_only)
    try:
        for job in jobs:
            reader.verify(job)
        engines = {id(x.engine): x.engine for x in layers if x.engine is not None}
        for eng in engines.values():
            eng.synchronize()
            eng.cache.clear()        # device copies of the old state
        adopt = [j for j in jobs if _adoptable(j)]
        for store in {id(j.layer.access.store): j.layer.access.store for j in adopt}.values():
            store.drop_cache()       # adopted keys must not be cached
        for job in adopt:
            access, key = job.layer.access, (job.layer.access.layer, job.l)
            disk_links.adopt(access.store.disk, key, job.path,
                             {int(p): c for p, c in job.info["sums"].items()}, grad=False)
            access.store.set_step(key, float(job.info["step"]))
            access.store.bump_version(key)
        adopted = {id(j) for j in adopt}
        for job in jobs:
            if id(job) not in adopted:
                master, moments = reader.source(job)
                job.layer.access.write(job.l, master, moments)
        for layer in layers:
            layer.access.finish()
        for store in {id(x.access.store): x.access.store for x in layers
                      if x.access.store is not None}.values():
            store.flush()
    finally:
        reader.close()
    read = sum(j.geometry.offsets[POS_EXP_AVG if masters_only else POS_GRAD] if j.record else 0
               for j in jobs)
    return dict(experts=len(jobs), adopted=len(adopted), record_bytes_verified=read)
