"""A compact host store's gradient accumulators: an expert's fp32 gradient [P] exists only from
its backward to its step, so between steps the host holds only the format's master and moments.

A gradient is made (zero) when an access asks for it and dropped when a step zeroes it. Freeing
a 33 MB buffer and faulting in a fresh one for the next expert cost 11 ms per expert, so the
last SPARE_GRADS dropped ones are kept and reused (zeroed: warm pages) within an iteration; the
host optimizer frees them after the iteration's steps (`drop_spares`). Thread-safe.

Deliberately not here: fp32 records (their gradient row lives in the record), the disk tier's
(a row of the cached record).
"""

from __future__ import annotations

import threading

import torch

SPARE_GRADS = 2     # dropped gradients kept for the next to reuse


class HostGrads:
    """The gradients alive now, by key, and the spares."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, int], torch.Tensor] = {}
        self._spares: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def row(self, key: tuple[int, int], numel: int, create: bool) -> torch.Tensor | None:
        """The key's gradient (made zero if `create` and absent; None if neither)."""
        with self._lock:
            grad_P = self.live.get(key)
            if grad_P is None and create:
                spare = next((g for g in self._spares if g.numel() == numel), None)
                if spare is None:
                    grad_P = torch.zeros(numel)
                else:
                    self._spares.remove(spare)
                    grad_P = spare.zero_()
                self.live[key] = grad_P
            return grad_P

    def drop(self, key: tuple[int, int]) -> None:
        """The key was stepped: its gradient goes (kept as a spare while there is room)."""
        with self._lock:
            grad_P = self.live.pop(key, None)
            if grad_P is not None and len(self._spares) < SPARE_GRADS:
                self._spares.append(grad_P)

    def drop_spares(self) -> None:
        with self._lock:
            self._spares.clear()

    def bytes(self) -> int:
        """Bytes of the gradients alive and kept."""
        with self._lock:
            return sum(4 * g.numel() for g in [*self.live.values(), *self._spares])
