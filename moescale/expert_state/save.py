"""save_expert_shards: every rank writes the experts it holds; nothing is gathered anywhere.

Each rank writes one directory `<directory>/expert-shards-<tag>/rank<r:05d>/` (index.py has
the format): `experts.safetensors` with the fp32 masters and AdamW moments of its resident and
host-tier experts (written one tensor at a time, each with its xxh3-64 sum), hard links to its
disk-tier store's record files (`layer<l:03d>/expert<e:05d>.bin`: no copy, no space; the store
freezes them and writes its next version of an expert to a new file; across filesystems they
are copied and checked against the sums the store wrote), and `index.json`. It is written as
`rank<r:05d>.tmp/`, fsynced file by file and directory by directory, then renamed into place:
a crash leaves the old state or a whole shard, never half of one. A name already taken (the
same tag saved twice, e.g. after a resume at that step) gets a suffix `.1`, `.2`, ...: a
shard a commit point may name is never written over.

The returned entry is small plain data (index.py): the rank's directory, the sha256 of its
index and which global experts of each layer it holds. The caller (rank 0 of a trainer) puts
every rank's entry into its commit point; until then the shard is unreferenced.

Peak memory: one tensor of a resident/host expert in flight (none for fp32 CPU tensors, which
are written from their own memory), nothing for disk-tier records.

Call it between steps (after the experts' step): gradient accumulators are not saved.
Not here: the dense parameters and optimizer state (the caller's), removing old shards (the
caller removes `expert-shards-<tag>/` with the checkpoint that names it).
"""

from __future__ import annotations

import errno
import math
import os
import shutil

from moescale.atomic import fsync_dir, publish_dir
from moescale.expert_state.holdings import HeldLayer, held_layers
from moescale.expert_state.index import (FORMAT, INDEX, TENSOR_FILE, digest, encode,
                                         layout_of, ranges_of, shards_dir, tensor_name)
from moescale.expert_state.tensorfile import TensorSpec, write_tensors
from moescale.offload.checkpoint import link_disk_store
from moescale.offload.direct_io import CHUNK_BYTES, CorruptReadError
from moescale.offload.records import POS_EXP_AVG, POS_EXP_AVG_SQ, POS_MASTER
from moescale.offload.state_format import record_info


def selected(layer: HeldLayer, share: tuple[int, int] | None) -> list[int]:
    """Local indices of the layer's experts this rank handles: all it holds, or block
    share[0] of share[1] contiguous blocks (experts several ranks see, as a node's store)."""
    n = len(layer.expert_ids)
    if share is None:
        return list(range(n))
    i, ways = share
    if not (isinstance(i, int) and isinstance(ways, int) and 0 <= i < ways):
        raise ValueError(f"share={share!r} must be (index, count) with 0 <= index < count, "
                         "e.g. (local_rank, ranks sharing the store)")
    return list(range(i * n // ways, (i + 1) * n // ways))


def _fresh_rank_dir(root: str, rank: int) -> str:
    name = f"rank{rank:05d}"
    for k in range(1, 1 << 20):
        if not os.path.exists(os.path.join(root, name)):
            return name
        name = f"rank{rank:05d}.{k}"
    raise OSError(errno.EEXIST, f"no free shard name under {root!r}")


def _synchronize(layers: list[HeldLayer]) -> None:
    """Wait for queued expert steps of every offload engine involved (each once)."""
    seen = set()
    for layer in layers:
        if layer.engine is not None and id(layer.engine) not in seen:
            seen.add(id(layer.engine))
            layer.engine.synchronize()


def _link_records(layers, picks, tmp: str) -> dict:
    """Link the disk-tier records of the picked experts into tmp; returns info per (key, e)."""
    out, stores = {}, {}
    for layer in layers:
        if layer.access.tier == "disk":
            store = layer.access.store
            stores.setdefault(id(store), (store, {}))[1][layer.access.layer] = layer
    for store, by_layer in stores.values():
        def dest_of(key, _by=by_layer):
            layer = _by.get(key[0])
            if layer is None or key[1] not in picks[layer.key]:
                return None
            e = layer.expert_ids[key[1]]
            return os.path.join(tmp, f"layer{key[0]:03d}", f"expert{e:05d}.bin")

        for key, info in link_disk_store(store, dest_of).items():
            layer = by_layer[key[0]]
            e = layer.expert_ids[key[1]]
            sums = {str(p): info["sums"][str(p)]
                    for p in (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ)}
            out[layer.key, e] = dict(file=f"layer{key[0]:03d}/expert{e:05d}.bin",
                                     **record_info(store.format, store.disk.geometries[key[0]]),
                                     step=info["step"], moments=True, sums=sums)
    return out


def _tensor_specs(layers, picks) -> tuple[list[TensorSpec], dict]:
    """The safetensors entries of the resident and host-tier experts, and their index info."""
    specs, infos = [], {}
    for layer in layers:
        if layer.access.tier == "disk":     # linked by _link_records
            continue
        for l in picks[layer.key]:
            e = layer.expert_ids[l]
            master, moments = layer.access.read(l)
            parts = [("master", master)] + ([] if moments is None else
                                            [("exp_avg", moments[0]), ("exp_avg_sq", moments[1])])
            for part, tensors in parts:
                for name, shape in layer.spec:
                    specs.append(TensorSpec(tensor_name(layer.key, e, part, name), shape,
                                            lambda t=tensors[name]: t))
            infos[layer.key, e] = dict(file=TENSOR_FILE, moments=moments is not None,
                                       step=None if moments is None else float(moments[2]),
                                       parts=[p for p, _ in parts])
    return specs, infos


def save_expert_shards(model, directory: str, *, rank: int, tag: str, optimizer=None,
                       engine=None, share: tuple[int, int] | None = None) -> dict:
    """Write the experts this process holds under `directory` (see the module docstring);
    returns this rank's manifest entry. Every rank that holds experts calls it (with data-
    parallel replicas of the experts, or a node-shared store on several nodes: the ranks of
    one replica only). `optimizer`: the torch optimizer of resident experts (their AdamW
    moments are saved with them); `engine`: the OffloadEngine of offloaded experts (default:
    the one they name); `share=(i, n)`: save block i of n of each layer's experts (ranks
    sharing one store split it)."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r} must be this process's rank (an int >= 0)")
    if not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r} does not exist; create it first (the "
                         "checkpoint directory)")
    root = os.path.join(directory, shards_dir(tag))
    layers = held_layers(model, optimizer, engine)
    picks = {layer.key: selected(layer, share) for layer in layers}
    _synchronize(layers)
    os.makedirs(root, exist_ok=True)
    name = _fresh_rank_dir(root, rank)
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        infos = _link_records(layers, picks, tmp)
        specs, tensor_infos = _tensor_specs(layers, picks)
        nbytes = sum(4 * math.prod(spec.shape) for spec in specs)
        if specs:
            sums = write_tensors(os.path.join(tmp, TENSOR_FILE), specs,
                                 metadata=dict(format=FORMAT, rank=str(rank)))
            for (key, e), info in tensor_infos.items():
                parts = info.pop("parts")
                info["sums"] = {f"{part}/{n}": sums[tensor_name(key, e, part, n)]
                                for part in parts for n, _ in
                                next(x for x in layers if x.key == key).spec}
            infos.update(tensor_infos)
        for info in infos.values():
            if info["file"] != TENSOR_FILE:
                nbytes += info.get("state_bytes") or 3 * info["stride"]
        index = dict(format=FORMAT, rank=rank, chunk_bytes=CHUNK_BYTES, layers={
            layer.key: dict(num_experts=layer.num_experts, layout=layout_of(layer.spec),
                            experts={str(layer.expert_ids[l]): infos[layer.key,
                                                                     layer.expert_ids[l]]
                                     for l in picks[layer.key]})
            for layer in layers})
        data = encode(index)
        with open(os.path.join(tmp, INDEX), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish_dir(tmp, final)
        fsync_dir(directory)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, CorruptReadError):   # a damaged store file, not a full disk
            raise
        raise OSError(err.errno, f"could not write rank {rank}'s expert shard under {root!r} "
                      f"({err.strerror or err}); earlier checkpoints are intact (free disk "
                      "space or choose another directory, then save again)") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(format=FORMAT, rank=rank, path=f"{shards_dir(tag)}/{name}",
                index_sha256=digest(data), bytes=nbytes,
                experts={layer.key: ranges_of(layer.expert_ids[l] for l in picks[layer.key])
                         for layer in layers})
