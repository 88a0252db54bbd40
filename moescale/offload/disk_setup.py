"""The disk tier's set-up: its directory checked and claimed, each layer's record files written
(or another process's files adopted), before any training access.

`reserve(total_bytes)` checks once, before anything is written, that the directory has room for
every layer's files; `add_experts` writes a layer (the master of each expert, zero moments as a
sparse tail), refusing a host cache of fewer than two records, a directory without room and a
layer directory that is a symbolic link, and removes a half-written layer; the first layer
claims the directory for this store (moescale/dir_lock.py) until `close`. `attach_files` knows a
layer whose files another process of the machine wrote (shared_store/node_disk.py).

`DiskSetUp` is a part of DiskTier (disk_tier.py), whose state it fills: the layers' geometries,
file generations and chunk sums.

Deliberately not here: reads, slots and eviction (disk_tier.py), write-back
(disk_writeback.py), the file format (record_files.py, records.py).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from moescale.dir_lock import claim_directory
from moescale.offload.record_files import write_layer_files
from moescale.offload.records import POS_GRAD
from moescale.offload.state_format import RecordGeometry
from moescale.offload.store_types import check_directory


class DiskSetUp:
    """Set-up of DiskTier's files (see the module docstring)."""

    def reserve(self, total_bytes: int) -> None:
        """Check once, before any file is written, that the directory has room for
        `total_bytes` of expert files (the sum over every layer to come)."""
        check_directory(self.directory, total_bytes * self.reserve_disk)
        self._need = max(self._need, total_bytes)

    def register_layer(self, numel: int) -> int:
        """Know a layer of experts of numel parameters (its files are written elsewhere)."""
        self.numels.append(numel)
        self.geometries.append(RecordGeometry(self.state, numel))
        return len(self.numels) - 1

    def add_layer(self, numel: int, num_experts: int, init) -> None:
        """Write the layer's files (record_files.py: init(e) as the master, None: zero and
        unwritten; zero moments as a sparse tail; a previous run's files unlinked first)."""
        layer = self.register_layer(numel)
        for e, sums in enumerate(write_layer_files(
                self.io, self._layer_dir(layer), lambda e: self.path((layer, e), 0),
                self.geometries[layer], num_experts, init)):
            self.sums[(layer, e)] = sums
            self.gen[(layer, e)] = 0

    def add_experts(self, layout, num_experts: int, master,
                    steps_E: torch.Tensor | None = None) -> None:
        """Write a layer of records whose masters are master(e) (None: zero, not written)."""
        geo = RecordGeometry(self.state, layout.numel)
        record = geo.total
        cache = self.host_cache_bytes
        if cache and 2 * record > cache:
            raise ValueError(
                f"host_cache_bytes={cache} holds fewer than two expert records of {record} "
                f"bytes each; raise it to at least {2 * record}")
        # the files' blocks: the rows that persist (the gradient row is a sparse tail, written
        # only when accumulation across micro-batches spills it)
        written = sum(self.geometries[lay].offsets[POS_GRAD] * n
                      for lay, n in enumerate(self.counts))
        need = written + geo.offsets[POS_GRAD] * num_experts
        check_directory(self.directory, self.reserve_disk * max(0, max(need, self._need) -
                                                                written))
        self._need = max(self._need, need)
        if self._dir_lock is None:     # this store owns the directory while it is open
            self._dir_lock = claim_directory(
                self.directory, f"the disk tier's directory {self.directory!r}",
                "give each run its own offload.directory")
        layer = len(self.numels)
        if os.path.islink(self._layer_dir(layer)):    # its files would be deleted there
            raise ValueError(f"{self._layer_dir(layer)!r} is a symbolic link; the disk "
                             "tier never follows one where it deletes and writes: remove it")
        try:
            self.add_layer(layout.numel, num_experts, master)
        except BaseException:   # leave nothing behind: a half-written layer is useless
            shutil.rmtree(self._layer_dir(layer), ignore_errors=True)
            raise
        self.layouts.append(layout)
        self.counts.append(num_experts)
        if layer == 0 and self.io.direct is False and self.io._try_direct:
            warnings.warn(f"the filesystem of {self.directory!r} refuses O_DIRECT "
                          "(tmpfs?): the disk tier uses buffered I/O with "
                          "posix_fadvise(DONTNEED) there", RuntimeWarning, stacklevel=5)

    def attach_files(self, layout, num_experts: int, sums: dict) -> None:
        """A layer whose files another process wrote (generation 0) with these chunk sums
        (per expert: row position -> sums); nothing is written."""
        layer = self.register_layer(layout.numel)
        for e in range(num_experts):
            self.gen[(layer, e)] = 0
            self.sums[(layer, e)] = {int(p): list(c) for p, c in sums[(layer, e)].items()}
        self.layouts.append(layout)
        self.counts.append(num_experts)

    def shared_records(self) -> list[torch.Tensor]:
        raise ValueError("shared_state() needs tier='host' with shared_memory=True")

    def release_directory(self) -> None:
        """Give the claimed directory back (at close, also after a failed write-back)."""
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None
