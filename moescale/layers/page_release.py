"""Give the pages of a saved hidden back to the kernel as soon as backward is done with them.

An MoE layer's backward writes E experts' weight gradients (E times a dense FFN's) while the
saved pre-activation hidden h_RF (R x F: the largest activation) is still held, whole, until
the autograd Function returns. On a CPU that sum is the step's peak resident set: at 64 experts
of d_model 512 the gradients alone are 1.2x a dense FFN's whole working set. The grouped
kernels walk the hidden chunk by chunk and never read a chunk again once its backward is done,
so each chunk's pages can go back then (`madvise(MADV_DONTNEED)` on the page-aligned interior
of its rows): the hidden shrinks while the gradients grow, and the peak drops by about the
hidden's size. The tensor itself stays allocated (and is freed as usual); its released pages
read as zeros.

Released only when this is safe and free:
- the hidden lives on the CPU and is the very buffer the forward allocated (same data pointer:
  no saved-tensor hook substituted a copy that something else may still hold), contiguous;
- autograd will not run this graph again (`retain_graph` / `create_graph` keep saved tensors
  for another backward; the current graph task's keep_graph flag says so);
- it is at least `RELEASE_MIN_BYTES` (glibc serves blocks this large by mmap and unmaps them
  when freed: releasing only moves that work earlier; a smaller block comes from the heap,
  whose next user would fault its pages in again);
- Linux with a C library exposing madvise (elsewhere nothing is released).

Legend: R rows, F expert hidden width.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import torch

MADV_DONTNEED = 4
RELEASE_MIN_BYTES = 32 << 20     # glibc's largest dynamic mmap threshold on 64-bit


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def _graph_kept() -> bool:
    """True when the running backward keeps saved tensors for another pass (or we cannot
    tell)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep is None:
        return True
    try:
        return bool(keep())
    except RuntimeError:         # not inside a backward pass
        return True


def hidden_pointer(h_RF: torch.Tensor | None) -> int | None:
    """What forward records of a hidden it allocated (its data pointer), for `releasable`."""
    return None if h_RF is None else h_RF.data_ptr()


def releasable(h_RF: torch.Tensor | None, forward_ptr: int | None) -> bool:
    """Whether backward may release h_RF's pages chunk by chunk (see the module docstring).
    Call it inside the autograd Function's backward."""
    return (h_RF is not None and forward_ptr is not None and h_RF.device.type == "cpu"
            and h_RF.data_ptr() == forward_ptr and h_RF.is_contiguous()
            and h_RF.numel() * h_RF.element_size() >= RELEASE_MIN_BYTES
            and _madvise() is not None and not _graph_kept())


def release_rows(rows_NF: torch.Tensor | None) -> None:
    """Hand the whole pages inside these contiguous rows back to the kernel (they then read
    as zeros). Partial pages at either end stay: a neighbouring chunk may still need them."""
    if rows_NF is None or rows_NF.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = rows_NF.data_ptr()
    end = start + rows_NF.numel() * rows_NF.element_size()
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        _madvise()(lo, hi - lo, MADV_DONTNEED)
