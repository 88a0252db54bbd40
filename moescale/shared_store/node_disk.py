"""A node's expert store on the disk tier: one directory of record files shared by its ranks.

`node_disk_store(source, group, directory)` (collective over the node's ranks): rank 0 writes
one record file per expert from the masters of `source` (an ExpertStore holding the same
experts, e.g. the node's host store), then broadcasts the chunk sums it recorded; the other
ranks attach to the same files (`ExpertStore.attach_disk`). Every rank then holds its own
`DiskTier` over the files: its own host slots, read-ahead, write-behind, and its own view of
each expert's file generation (a checkpoint freezes files; the next write goes to a new file),
gradient-on-disk flag, chunk sums and step count.

`DiskCoherence(store, group).fence()` makes those views one, at points where no rank is inside
a pass (every micro-batch's start, before clipping, after the expert steps; before a pass
without backward, `fence_if_changed`, when a checkpoint was loaded or saved since):
  1. write back every dirty record and empty the host slots (the next access reads the file);
  2. barrier: every rank's writes are in the files;
  3. all-gather what changed in each rank's view since the last fence (between two fences each
     record has at most one writer: the owner of its gradient in a pass, of its step, or the
     rank loading its block of a checkpoint); the newest generation wins;
  4. thaw: records still frozen by a checkpoint (linked into it; every rank agrees after 3) are
     rewritten to their next generation by rank e % W, then steps 1-3 again. So no write inside
     a pass ever moves a file that another rank might be reading.

Not here: the experts computed on the store (experts.py, streamed.py), the step (step.py),
several nodes (each node would hold its own directory; the inter-node gradient average reads
host accumulators and is not done for this tier).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moescale.offload.records import G, M
from moescale.offload.store import ExpertStore, Key, StoreConfig
from moescale.parallel.all_to_all import broadcast_outcome, collective_errors


def node_disk_store(source: ExpertStore, group, directory: str, *,
                    host_cache_bytes: int | None = None, io_threads: int = 4,
                    direct_io: bool = True) -> ExpertStore:
    """Collective over `group`: the experts of `source` in record files under `directory`
    (created), one store per rank over the same files (see the module docstring)."""
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    config = StoreConfig(tier="disk", directory=directory, host_cache_bytes=host_cache_bytes,
                         io_threads=io_threads, direct_io=direct_io)
    store, outcome = None, ("ok", None)
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            store = ExpertStore(config)
            store.reserve_disk(sum(4 * lay.numel * 4 * n for lay, n in
                                   zip(source.layouts, source.num_experts)))
            for layer, (layout, num) in enumerate(zip(source.layouts, source.num_experts)):
                store.add_layer(layout, num, lambda e, layer=layer: source.read_record(
                    (layer, e))[0][0])
                for e in range(num):
                    store.set_step((layer, e), source.step_of((layer, e)))
            outcome = ("ok", {key: store.disk.sums[key] for key in store.keys()})
        except (OSError, ValueError) as err:
            outcome = ("error", f"rank {src} could not write the node's expert files under "
                                f"{directory!r}: {err}")
    sums = broadcast_outcome(outcome, src, group, "node disk store broadcast")
    if rank != 0:
        store = ExpertStore.attach_disk(config, source.layouts, sums)
        for key in store.keys():
            store.set_step(key, source.step_of(key))
    with collective_errors("node disk store barrier", group):
        dist.barrier(group=group)
    return store


class DiskCoherence:
    """Fences that keep the node's per-rank views of one disk-tier store equal (see the
    module docstring)."""

    def __init__(self, store: ExpertStore, group) -> None:
        if store.config.tier != "disk":
            raise ValueError(f"DiskCoherence needs a disk-tier store, not {store.config.tier!r}")
        self.store, self.group = store, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.fences = 0
        self._seen = self._views()

    def _view(self, key: Key) -> tuple:
        disk = self.store.disk
        sums = tuple(sorted((p, tuple(c)) for p, c in disk.sums[key].items()))
        return (disk.gen[key], key in disk.frozen, key in disk.grad_on_disk, sums,
                self.store.step_of(key))

    def _views(self) -> dict[Key, tuple]:
        return {key: self._view(key) for key in self.store.keys()}

    def _apply(self, key: Key, view: tuple) -> None:
        disk = self.store.disk
        gen, frozen, grad, sums, step = view
        disk.gen[key] = gen
        (disk.frozen.add if frozen else disk.frozen.discard)(key)
        (disk.grad_on_disk.add if grad else disk.grad_on_disk.discard)(key)
        disk.sums[key] = {p: list(c) for p, c in sums}
        self.store.set_step(key, step)
        self.store.bump_version(key)

    def _round(self) -> None:
        self.store.drop_cache()          # write back, then empty this rank's host slots
        with collective_errors("disk store fence (barrier)", self.group):
            dist.barrier(group=self.group)
        now = self._views()
        mine = {key: view for key, view in now.items() if self._seen.get(key) != view}
        every: list = [None] * self.size
        with collective_errors("disk store fence (all-gather of file views)", self.group):
            dist.all_gather_object(every, mine, group=self.group)
        best: dict[Key, tuple] = {}
        for changes in every:
            for key, view in changes.items():
                if key not in best or view[0] > best[key][0]:
                    best[key] = view
        for key, view in best.items():
            if now[key] != view:
                self._apply(key, view)
        self._seen = self._views()

    def fence(self) -> None:
        """Collective over the node: every rank's writes in the files, one view of them, no
        frozen file left (see the module docstring)."""
        self.fences += 1
        self._round()
        frozen = sorted(self.store.disk.frozen)
        if not frozen:
            return
        for key in frozen:
            if key[1] % self.size == self.rank:
                self.store.acquire(key, M)
                self.store.release(key, dirty=True, rows=M)     # copy on write: a new file
        self._round()
        assert not self.store.disk.frozen, sorted(self.store.disk.frozen)[:4]

    def fence_if_changed(self) -> None:
        """Collective over the node: a fence when any rank's view changed since the last one
        (a checkpoint loaded or saved outside the training loop's fences); else one small
        all-reduce. For passes without a backward (evaluation, sampling)."""
        changed = torch.tensor([float(self._views() != self._seen)])
        with collective_errors("disk store view check (all-reduce)", self.group):
            dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        if changed.item():
            self.fence()

    def grad_sq(self, keys) -> torch.Tensor:
        """Sum of squares of the gradient accumulators of `keys` (read from this rank's
        view; call after a fence)."""
        total = torch.zeros((), dtype=torch.float32)
        for key in keys:
            rec = self.store.acquire(key, G)
            try:
                total += rec.grad_P.float().square().sum()
            finally:
                self.store.release(key)
        return total
