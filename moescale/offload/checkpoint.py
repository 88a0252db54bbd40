"""Atomic checkpoints of an ExpertStore: fp32 masters, gradient accumulators, Adam moments and
step counts of every expert, on either tier.

Layout under the checkpoint directory:

    expert-store-{tag}/meta.json        layouts, expert counts, per-expert step counts
    expert-store-{tag}/layer{l:03d}.bin  raw fp32 [E, 4, P] (the store's record rows)
    expert-store.LATEST                  the name of the last complete expert-store-* directory

A save writes a new `expert-store-{tag}.tmp` directory, fsyncs every file and the directory,
renames it into place, then replaces `expert-store.LATEST` atomically (temp file, fsync,
os.replace) and only then removes older store directories. A failure at any point (disk
full, a read error) removes the partial directory and leaves LATEST and the checkpoint it names
intact. Records stream one expert at a time, so a disk-tier store never needs its size in RAM.

An expert-parallel run writes the same format for all E experts of a layer (`save_records` over
records gathered from the ranks) and each rank loads its slice (`load_store(...,
first_expert, total_experts)`), so such a checkpoint equals a one-process store's.

Deliberately not here: dense parameters and the dense optimizer (the trainer's own checkpoint),
the gathering over ranks (moescale/train/ep_offload_backend.py).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from moescale.atomic import atomic_write_text, fsync_dir
from moescale.offload.store import ExpertStore

LATEST = "expert-store.LATEST"


def save_store(store: ExpertStore, directory: str, tag: str) -> str:
    """Write the whole store under directory (atomically); returns the store directory."""
    return save_records(directory, tag, store.layouts, store.num_experts,
                        lambda layer, e: store.read_record((layer, e)))


def save_records(directory: str, tag: str, layouts, num_experts: list[int], read) -> str:
    """save_store's format from any source: read(layer, e) -> (record [4, P] fp32, step count),
    called in file order (expert-parallel runs write their gathered shards with it)."""
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
        meta = {"layouts": [list(zip(lay.names, lay.shapes)) for lay in layouts],
                "num_experts": list(num_experts), "steps": {}}
        for layer, num in enumerate(num_experts):
            path = os.path.join(tmp, f"layer{layer:03d}.bin")
            with open(path, "wb") as f:
                for e in range(num):
                    data_4P, step = read(layer, e)
                    f.write(memoryview(data_4P.contiguous().numpy()).cast("B"))
                    meta["steps"][f"{layer},{e}"] = float(step)
                f.flush()
                os.fsync(f.fileno())
        atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta))
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(directory)
        atomic_write_text(os.path.join(directory, LATEST), name)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
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


def load_store(store: ExpertStore, directory: str, first_expert: int = 0,
               total_experts: int | None = None) -> None:
    """Fill `store` (same layers and experts) from the checkpoint LATEST names.

    Expert-parallel shard: the checkpoint holds `total_experts` per layer and the store the
    `store.num_experts` starting at `first_expert` (global ids)."""
    latest = os.path.join(directory, LATEST)
    if not os.path.exists(latest):
        raise ValueError(f"no expert-store checkpoint under {directory!r} ({LATEST} is missing)")
    with open(latest) as f:
        src = os.path.join(directory, f.read().strip())
    with open(os.path.join(src, "meta.json")) as f:
        meta = json.load(f)
    want = [[list(x) for x in zip(lay.names, lay.shapes)] for lay in store.layouts]
    got = [[[n, list(s)] for n, s in layer] for layer in meta["layouts"]]
    expected = store.num_experts if total_experts is None else \
        [total_experts] * len(store.num_experts)
    if got != [[[n, list(s)] for n, s in layer] for layer in want] or \
            meta["num_experts"] != expected:
        raise ValueError(f"the checkpoint in {src!r} holds experts of another shape "
                         f"({meta['num_experts']} experts per layer, this model {expected}); "
                         "build the same model")
    for layer, num in enumerate(store.num_experts):
        numel = store.layouts[layer].numel
        with open(os.path.join(src, f"layer{layer:03d}.bin"), "rb") as f:
            f.seek(first_expert * 16 * numel)
            for e in range(num):
                buf = torch.empty(4, numel, dtype=torch.float32)
                if f.readinto(memoryview(buf.numpy()).cast("B")) != 16 * numel:
                    raise ValueError(f"checkpoint file layer{layer:03d}.bin in {src!r} is "
                                     "truncated")
                rec = store.acquire((layer, e))
                try:
                    rec.data_4P.copy_(buf)
                    rec.step_t.fill_(meta["steps"][f"{layer},{first_expert + e}"])
                    store.bump_version((layer, e))  # device copies of the old state are stale
                finally:
                    store.release((layer, e), dirty=True)
