"""The host tier of the ExpertStore: every expert's record in RAM, beside the disk tier.

Per layer one tensor: `[E, 4, P]` fp32 records (master, gradient, moments), pinned under CUDA,
optionally in shared memory (`share_memory_()`) so that several local ranks map one copy
(`shared_records()` in the owner, `attach_records` in the others); or, for a compact format
(state_format.py), `[E, B]` byte records of master and moments in 64-byte rows, whose fp32
gradients live only from an expert's backward to its step (host_grads.py).

`HostTier` has the disk tier's methods (disk_tier.py, `DiskTier`), so that the store and its
users never ask which tier they hold: acquiring a record here is taking views of its rows;
the schedule, skips, flushes, slot sizes and I/O figures are the disk tier's and nothing here.

Deliberately not here: the record API and step counts (store.py), the disk tier (disk_tier.py).

Legend: E experts of a layer, P parameters of one expert, B bytes of one compact record.
"""

from __future__ import annotations

from typing import Callable

import torch

from moescale.offload import records
from moescale.offload.host_grads import HostGrads
from moescale.offload.records import POS_GRAD, POS_MASTER
from moescale.offload.state_format import RecordGeometry, StateFormat
from moescale.offload.store_types import GRAD, LOGICAL_POS, MASTER, ExpertRecord, Key


class HostTier:
    """Expert records in RAM (see the module docstring); the same methods as DiskTier."""

    def __init__(self, state: StateFormat, host_grads: HostGrads, *, pin_memory: bool = False,
                 shared_memory: bool = False) -> None:
        self.state, self.grads = state, host_grads
        self.pin_memory, self.shared_memory = pin_memory, shared_memory
        self.data: list[torch.Tensor] = []     # per layer: [E, 4, P] fp32 or [E, B] bytes
        self.numels: list[int] = []

    # ----------------------------------------------------------------- set-up
    def reserve(self, total_bytes: int) -> None:
        """No files: nothing to check."""

    def add_experts(self, layout, num_experts: int,
                    master: Callable[[int], torch.Tensor | None], steps_E: torch.Tensor) -> None:
        """A layer of records whose masters are master(e) (None: zero)."""
        if not self.state.exact:     # byte records of master and moments (no gradient row)
            geo = RecordGeometry(self.state, layout.numel, align=64)
            data_EB = torch.zeros(num_experts, geo.offsets[POS_GRAD], dtype=torch.uint8)
            if self.pin_memory:
                data_EB = data_EB.pin_memory()
            for e in range(num_experts):
                master_P = master(e)
                if master_P is not None:     # None: stays zero
                    geo.typed(data_EB[e], POS_MASTER).copy_(master_P)   # round to nearest
            self.attach_records(layout.numel, data_EB)
            return
        data_E4P = torch.zeros(num_experts, 4, layout.numel, dtype=torch.float32)
        if self.shared_memory:
            data_E4P.share_memory_()
            steps_E.share_memory_()
            if self.pin_memory:  # pin the shared pages in place (no copy)
                torch.cuda.cudart().cudaHostRegister(
                    data_E4P.data_ptr(), data_E4P.numel() * data_E4P.element_size(), 0)
        elif self.pin_memory:
            data_E4P = data_E4P.pin_memory()
        for e in range(num_experts):
            master_P = master(e)
            if master_P is not None:     # None: stays zero
                data_E4P[e, MASTER].copy_(master_P)
        self.attach_records(layout.numel, data_E4P)

    def attach_records(self, numel: int, data: torch.Tensor) -> None:
        """A layer over existing records (another process's shared memory)."""
        self.numels.append(numel)
        self.data.append(data)

    def shared_records(self) -> list[torch.Tensor]:
        """Per layer the [E, 4, P] records in shared memory (to hand to other processes)."""
        if not self.shared_memory:
            raise ValueError("shared_state() needs tier='host' with shared_memory=True")
        return list(self.data)

    def geometry(self, layer: int) -> RecordGeometry:
        """Where a record's rows lie (compact byte records: 64-byte rows)."""
        return RecordGeometry(self.state, self.numels[layer], align=64)

    # ----------------------------------------------------------------- access
    def record(self, key: Key, rows: int, step_t: torch.Tensor) -> ExpertRecord:
        """Views of the record's rows (a compact record's gradient: made if `rows` asks)."""
        layer, e = key
        if not self.state.exact:
            geo, data_B = self.geometry(layer), self.data[layer][e]
            views = [geo.typed(data_B, pos) for pos in LOGICAL_POS if pos != POS_GRAD]
            views.insert(GRAD, self.grads.row(key, self.numels[layer],
                                              create=bool(rows & records.G)))
            return ExpertRecord(key, views, step_t)
        data_4P = self.data[layer][e]
        return ExpertRecord(key, data_4P.unbind(0), step_t, data_4P)

    def release(self, key: Key, dirty: int = 0, grad_zero: bool = False) -> None:
        """grad_zero: a step zeroed the gradient (a compact record's goes)."""
        if grad_zero and not self.state.exact:
            self.grads.drop(key)

    def thread_read_wait_s(self) -> float:
        return 0.0

    # ----------------------------------------------------------------- the disk tier's, none here
    def announce(self, accesses, keep=None) -> None:
        """The order of coming accesses: nothing to read ahead or evict."""

    def skip(self, key: Key) -> None:
        """An announced access that will not happen: nothing to do."""

    def flush(self, drop: bool = False) -> None:
        """Every record is in place already."""

    def set_slot_rows(self, rows: int, host_cache_bytes: int | None = None) -> None:
        """No host slots: every row is always there."""

    def path(self, key: Key) -> str:
        raise ValueError(f"expert {key} lives in host RAM: the host tier has no files")

    def cache_bytes(self) -> int:
        return 0

    bytes_read = bytes_written = peak_cache_bytes = 0

    def host_bytes(self) -> int:
        """Its records and the gradients alive or kept for reuse."""
        return sum(t.numel() * t.element_size() for t in self.data) + self.grads.bytes()

    def memory(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to write back."""
