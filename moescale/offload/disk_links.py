"""A disk-tier store's files in checkpoints: freeze the current files under hard links
(`snapshot`) and make a checkpoint's verified files the current ones (`adopt`).

A frozen file is never written again: the tier's next write of that expert goes to a new file
(copy on write, disk_tier.py), so a checkpoint's link keeps the bytes it linked. Both work on the
tier's own state under its lock (they are the tier's checkpoint half, kept apart for size).

Deliberately not here: the checkpoint's directory, manifest and verification (checkpoint.py,
expert_state/).
"""

from __future__ import annotations

import os

from moescale.offload.disk_tier import DiskTier, Key


def snapshot(tier: DiskTier, link) -> dict[Key, dict]:
    """After a flush: call link(path, key) for every expert's current file, freeze them and
    return per key its chunk sums and gradient flag."""
    tier.flush()
    with tier._lock:
        out = {}
        for key in tier.gen:
            path = tier.path(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            link(path, key)
            tier.frozen.add(key)
            out[key] = dict(sums={p: list(c) for p, c in tier.sums[key].items()},
                            grad=key in tier.grad_on_disk)
        return out


def adopt(tier: DiskTier, key: Key, src: str, sums: dict[int, list[int]], grad: bool) -> None:
    """Make the (verified) file `src` the expert's current file by hard link; it stays frozen,
    so the first write goes to a new file. The key must not be cached."""
    with tier._lock:
        assert key not in tier._cache, f"adopt of {key} while it is cached"
        old, gen = tier.path(key), tier.gen[key] + 1
        os.link(src, tier.path(key, gen))
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
        tier.gen[key] = gen
        tier.frozen.add(key)
        tier.sums[key] = {p: list(c) for p, c in sums.items()}
        (tier.grad_on_disk.add if grad else tier.grad_on_disk.discard)(key)
