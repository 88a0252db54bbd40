"""Keep the experts' stacked weight-gradient storage from one backward to the next (CPU).

An MoE layer's stacked weight gradients are E times a dense FFN's: blocks far above glibc's
mmap threshold, so they come from the kernel as fresh pages and go back to it when freed. When
the gradients are dropped between steps (`zero_grad()`'s default sets .grad to None), every
backward faults its gradient pages in again, zero-filled, as its GEMMs first write them:
writing a fresh 256 MiB tensor took 95 ms against 38 ms into a kept one (2-core Xeon, one
thread); a d512, 64-expert bf16 GELU layer's forward + backward took 669 ms per step without
the kept storage and 579 ms with it (one thread, 9 interleaved repetitions). A dense FFN's (or
a per-expert loop's) small gradient blocks come back from the heap without that cost.

`GradBuffers.take(name, like)` hands out a tensor shaped like `like` on a storage the pool
keeps, when nothing but the pool holds that storage any more (its use count is 1: the tensor
handed out before was dropped by `zero_grad`, or consumed when autograd added it into an
existing .grad); otherwise it allocates, so a gradient anyone still holds is never written
over. At most `KEEP` storages per name: the one a kept `.grad` holds and one to accumulate
into it. The tensor handed out is a plain tensor on that storage (no view, no `_base`), so
autograd's AccumulateGrad takes it as the new .grad without a copy, as it does a fresh one.

The price: between steps the layer holds its gradients' bytes even while .grad is None (as
torch's CUDA caching allocator keeps freed blocks); `release()` drops them. CPU tensors only
(an accelerator's caching allocator already reuses its blocks), and only where torch exposes
a storage's use count (elsewhere `take` allocates every time, as before). Copies and pickles
of a pool are empty pools. The simulated device (devices.py) keeps its upload copies the same
way (`empty`), as many per size as its budget holds.
"""

from __future__ import annotations

import math

import torch

KEEP = 2


# torch's count of the references to a storage (None where this torch does not expose it)
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    return _STORAGE_USE_COUNT(storage._cdata)


class GradBuffers:
    """Per-name kept gradient storages (see the module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep       # storages kept per name
        self._kept: dict[str, list[torch.UntypedStorage]] = {}

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor shaped like `like`, on a kept free storage when
        there is one."""
        if like.device.type != "cpu" or _STORAGE_USE_COUNT is None:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        return self.empty(name, like.shape, like.dtype)

    def empty(self, name: str, shape, dtype: torch.dtype, keep: int | None = None
              ) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, on a kept free storage when there is one;
        `keep`: storages kept under this name (default: the pool's)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if _STORAGE_USE_COUNT is None:
            return torch.empty(shape, dtype=dtype)
        kept = [s for s in self._kept.get(name, ()) if s.nbytes() == nbytes]
        storage = next((s for s in kept if _use_count(s) == 1), None)
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            kept = (kept + [storage])[-(keep or self.keep):]
        self._kept[name] = kept
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))   # contiguous

    def held_bytes(self) -> int:
        """Bytes the pool keeps (in use by a .grad or free)."""
        return sum(s.nbytes() for kept in self._kept.values() for s in kept)

    def release(self) -> None:
        """Drop every kept storage (a gradient still held elsewhere stays valid)."""
        self._kept.clear()

    def __deepcopy__(self, memo) -> "GradBuffers":
        return GradBuffers(self.keep)

    def __reduce__(self):
        return (GradBuffers, (self.keep,))
