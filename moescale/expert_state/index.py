"""The format of expert shards: names, the per-rank index, the manifest entry, and its checks.

A rank's shard is one directory `expert-shards-<tag>/rank<r:05d>[.k]/` holding `index.json`:

    {"format": "moescale-expert-shards/1", "rank": r, "chunk_bytes": 8388608,
     "layers": {"<layer key>": {"num_experts": E, "layout": [[name, shape], ...],
                                "experts": {"<global e>": info}}}}

where info is, for a tensor of the safetensors file (resident and host-tier experts),
`{"file": "experts.safetensors", "step": s or null, "moments": bool, "sums": {"<part>/<name>":
xxh3-64 hex}}` (tensor `<layer key>/<e>/<part>/<name>`, part master | exp_avg | exp_avg_sq),
and for a disk-tier record file (a hard link of the store's), `{"file":
"layer<l:03d>/expert<e:05d>.bin", "stride": bytes per row, "step": s, "moments": true,
"sums": {"0": [...], "1": [...], "2": [...]}}` (the xxh3-64 of every `chunk_bytes` piece of
the master and moment rows, as the store wrote them).

The manifest entry `save_expert_shards` returns (plain data for the caller's commit point):
`{"format", "rank", "path": "expert-shards-<tag>/rank<r:05d>", "index_sha256", "experts":
{"<layer key>": [[first, stop], ...]}, "bytes"}`; `index_sha256` pins the index, the index
pins every tensor, so a commit point that verifies pins the whole shard.

Deliberately not here: writing and reading the tensors (save.py, load.py, tensorfile.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Iterable, Sequence

from moescale.offload.checkpoint import StoreCheckpointError

FORMAT = "moescale-expert-shards/1"
INDEX = "index.json"
TENSOR_FILE = "experts.safetensors"
PARTS = ("master", "exp_avg", "exp_avg_sq")
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_RANK_DIR = re.compile(r"expert-shards-[A-Za-z0-9_.-]{1,100}/rank\d{5}(\.\d+)?")
_FILE = re.compile(rf"{re.escape(TENSOR_FILE)}|layer\d{{3}}/expert\d{{5}}\.bin")


class ShardCheckpointError(StoreCheckpointError):
    """Expert shards that are missing, corrupt, or not this model's (a StoreCheckpointError,
    so a caller falling back to an older checkpoint on store errors catches it too)."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag in (".", ".."):
        raise ValueError(f"tag={tag!r} must be 1-100 characters of letters, digits, '_', '.' "
                         "and '-' (e.g. the step as f'{step:08d}')")
    return tag


SHARDS_PREFIX = "expert-shards-"


def shards_dir(tag: str) -> str:
    """The directory (relative to the checkpoint directory) of every rank's shard of `tag`."""
    return f"{SHARDS_PREFIX}{check_tag(tag)}"


def tensor_name(key: str, e: int, part: str, name: str) -> str:
    return f"{key}/{e}/{part}/{name}"


def ranges_of(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as [first, stop) runs: [0, 1, 2, 5] -> [[0, 3], [5, 6]]."""
    out: list[list[int]] = []
    for e in sorted(ids):
        if out and out[-1][1] == e:
            out[-1][1] += 1
        else:
            out.append([e, e + 1])
    return out


def layout_of(spec: Sequence[tuple[str, tuple[int, ...]]]) -> list:
    return [[n, list(s)] for n, s in spec]


def encode(index: dict) -> bytes:
    return json.dumps(index, sort_keys=True, separators=(",", ":")).encode()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_entry(entry) -> None:
    """A manifest entry's shape; ShardCheckpointError when it is not one of ours."""
    ok = isinstance(entry, dict) and entry.get("format") == FORMAT and \
        isinstance(entry.get("path"), str) and _RANK_DIR.fullmatch(entry["path"]) and \
        isinstance(entry.get("index_sha256"), str) and isinstance(entry.get("experts"), dict)
    if not ok:
        raise ShardCheckpointError(f"manifest entry {str(entry)[:200]!r} is not an expert-shard "
                                   f"entry of format {FORMAT!r}; the commit point is corrupt or "
                                   "of another version")
    for key, runs in entry["experts"].items():
        if not isinstance(runs, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and
                0 <= r[0] < r[1] for r in runs):
            raise ShardCheckpointError(f"manifest entry of {entry['path']!r}: the experts of "
                                       f"{key!r} are not [first, stop) runs ({str(runs)[:100]})")


def read_index(directory: str, entry: dict) -> dict:
    """The verified index of the shard `entry` names (its sha256 and format)."""
    path = os.path.join(directory, entry["path"], INDEX)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ShardCheckpointError(f"expert shard index {path!r} cannot be read "
                                   f"({err.strerror or err}); the checkpoint is incomplete or "
                                   "corrupt") from err
    if digest(data) != entry["index_sha256"]:
        raise ShardCheckpointError(f"expert shard index {path!r} does not match the sha256 the "
                                   "checkpoint recorded; the checkpoint is corrupt")
    try:
        index = json.loads(data)
        assert index["format"] == FORMAT and isinstance(index["layers"], dict)
    except (ValueError, KeyError, TypeError, AssertionError) as err:
        raise ShardCheckpointError(f"expert shard index {path!r} is not of format {FORMAT!r} "
                                   f"({err}); the checkpoint is corrupt") from err
    return index


def file_path(directory: str, entry: dict, info: dict) -> str:
    """The absolute path of an expert's file; names outside the shard are refused."""
    name = info.get("file") if isinstance(info, dict) else None
    if not isinstance(name, str) or not _FILE.fullmatch(name):
        raise ShardCheckpointError(f"the index of {entry['path']!r} names file {name!r}, which "
                                   "is not a shard file; the checkpoint is corrupt")
    return os.path.join(directory, entry["path"], name)
