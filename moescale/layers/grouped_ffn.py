"""Grouped expert FFN kernels: one GEMM per non-empty expert, hand-written backward.

Rows arrive grouped by expert (`counts[e]` consecutive rows each). The kernels walk the rows in
chunks (one expert's rows, split past `chunk_rows` rows) and do all the elementwise work of a
chunk in small reused buffers (backward's in blocks of `elementwise_rows` rows, each block's
passes back to back while it is in a core's cache); only what backward needs is full size: the
pre-activation hidden `h1_RF` (and the GLU gate input `h3_RF`), written by the GEMMs straight
into its slice. Each expert's weight gradient is written straight into its slice of one stacked
gradient. Nothing indexes a stacked weight inside autograd, so no expert pays a zero-filled
full-size gradient, and no R x F temporary is ever allocated (fresh large allocations cost
page faults that can rival the GEMMs on a CPU).

Saved for backward: the layer input and the pre-activation hidden(s); the activation is
recomputed per chunk, and (`release_hidden`) each chunk's pages of the saved hidden go back to
the kernel once its backward is done (page_release.py), so that the weight gradients written
expert by expert replace the hidden instead of adding to it at the peak. The autograd
Functions that wire these kernels in (`GroupedFFNRows`, and `GroupedFFNRouted`, which fuses
gather, score weighting and combine) live in grouped_ffn_autograd.py.

Kernel choice by what the CPU has, decided once per process and dtype: CPUs with native bf16
GEMMs (AVX512-BF16, AMX: ~3x fp32's speed on a 2-core EPYC) run bf16 GEMMs with bf16
elementwise work; CPUs without them (AVX2 machines run torch's bf16 GEMM ~150x slower than
fp32) compute each GEMM in fp32 from the low-precision operands and round
the result; the chunk-local elementwise work then runs in fp32 too ("work dtype"), and the
combine accumulates in fp32 before one rounding. Same inputs, same output precision, fp32
accumulation as on accelerators.

Legend: R rows, N rows of one chunk, T tokens, D model width, F expert hidden width, E experts.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from moescale.layers.activations import Activation
from moescale.layers.expert_threads import num_expert_workers, run_on_workers
from moescale.layers.grad_buffers import GradBuffers
from moescale.layers.page_release import release_rows

# Chunk buffers are sized to about this many bytes (fp32) so they stay in cache / the heap.
CHUNK_BYTES = 16 << 20
MIN_CHUNK_ROWS = 256
# Backward's elementwise passes run over blocks of about this many bytes per N x F tensor.
ELEMENTWISE_BYTES = 256 << 10
MIN_ELEMENTWISE_ROWS = 16


# CPU instruction-set flags (/proc/cpuinfo names) that give native low-precision GEMMs
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
NATIVE_FP16_FLAGS = ("avx512_fp16", "amx_fp16")


def lowp_gemm_choice(dtype: torch.dtype, cpu_flags) -> str:
    """"native" where the CPU's flags include a native GEMM for `dtype` (AVX512-BF16 / AMX),
    else "fp32" (upcast operands, fp32 GEMM, one rounding); "native" for fp32 itself.

    A pure function of the flags, so the choice can be forced (tests, reports); the kernels
    themselves ask oneDNN once per process (`_cpu_lacks_fast_lowp`), which reads the same
    CPUID bits."""
    wanted = {torch.bfloat16: NATIVE_BF16_FLAGS, torch.float16: NATIVE_FP16_FLAGS}.get(dtype)
    if wanted is None:
        return "native"
    return "native" if set(wanted) & set(cpu_flags) else "fp32"


@functools.cache
def _cpu_lacks_fast_lowp(dtype: torch.dtype) -> bool:
    """Decided once per process and dtype (a fact of the hardware, never changed)."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def needs_fp32_gemm(t: torch.Tensor) -> bool:
    """True when a GEMM on `t` should run in fp32 (low precision on a CPU without support)."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) and \
        _cpu_lacks_fast_lowp(t.dtype)


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of chunk-local elementwise work: fp32 where GEMMs are upcast, else t's."""
    return torch.float32 if needs_fp32_gemm(t) else t.dtype


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            bias: torch.Tensor | None = None, accumulate: bool = False) -> None:
    """out = a @ b (+ bias), or out += a @ b, in place, in the fastest exact way.

    Operands may differ in dtype from `out`; low-precision GEMMs on CPUs without native
    support run in fp32 and round once into `out`.
    """
    assert not (accumulate and bias is not None)
    if a.dtype == b.dtype == out.dtype and not needs_fp32_gemm(a):
        if accumulate:
            out.addmm_(a, b)
        elif bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, out=out)
        return
    a32, b32 = a.float(), b.float()
    if out.dtype == torch.float32:
        if accumulate:
            out.addmm_(a32, b32)
        elif bias is None:
            torch.mm(a32, b32, out=out)
        else:
            torch.addmm(bias.float(), a32, b32, out=out)
        return
    result = torch.mm(a32, b32)
    if bias is not None:
        result += bias.float()
    if accumulate:
        out.add_(result)
    else:
        out.copy_(result)


def segments(counts: list[int] | tuple[int, ...]):
    """Yield (expert, start, stop) for each expert with at least one row."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


def elementwise_rows(width: int, dtype: torch.dtype) -> int:
    """Rows per block of backward's elementwise work: about ELEMENTWISE_BYTES per tensor, so
    that a block's h1, ga and a stay in a core's L2 cache between the passes over them."""
    return max(MIN_ELEMENTWISE_ROWS, ELEMENTWISE_BYTES // (dtype.itemsize * max(width, 1)))


def chunk_rows(width: int) -> int:
    """Rows per chunk for a hidden width: about CHUNK_BYTES of fp32 per buffer."""
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * max(width, 1)))


def chunks(counts, max_rows: int):
    """Yield (expert, start, stop, first) over each expert's rows, at most max_rows at a time;
    `first` marks an expert's first chunk (weight gradients start there, then accumulate)."""
    start = 0
    for e, n in enumerate(counts):
        for s in range(start, start + n, max_rows):
            yield e, s, min(s + max_rows, start + n), s == start
        start += n


def _buffer_rows(counts, max_rows: int) -> int:
    return min(max_rows, max(counts, default=0))


@dataclass
class FFNWeights:
    """Stacked expert weights in compute precision; w3 is the GLU gate (None for plain FFN)."""

    w1_EDF: torch.Tensor
    w2_EFD: torch.Tensor
    w3_EDF: torch.Tensor | None = None
    b1_EF: torch.Tensor | None = None
    b2_ED: torch.Tensor | None = None

    def take(self, experts_A: torch.Tensor) -> "FFNWeights":
        """Copies of the experts listed in experts_A (int64), stacked in that order."""
        return FFNWeights(*(None if t is None else t.index_select(0, experts_A) for t in
                            (self.w1_EDF, self.w2_EFD, self.w3_EDF, self.b1_EF, self.b2_ED)))


# The stacked tensors of a layer of FFN experts, in FFNWeights' (and every store layout's) order.
PARAM_NAMES = ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED")


def _pick(t: torch.Tensor | None, e: int):
    return None if t is None else t[e]


def _activate(act: Activation, h_NF: torch.Tensor, h32_NF: torch.Tensor | None,
              out_NF: torch.Tensor) -> torch.Tensor:
    """out = act(h) in the work dtype; h32 (a work-dtype copy buffer) when dtypes differ."""
    if h32_NF is not None:
        h_NF = h32_NF.copy_(h_NF)
    return act.forward_into(h_NF, out_NF)


def _run_chunks(counts, max_rows: int, device: torch.device,
                make_buffers: Callable[[int], tuple], body: Callable) -> None:
    """body(e, s, t, first, buffers) over every chunk: serially, or with whole experts handed
    out to CPU worker threads (see expert_threads) from one queue, largest first: a worker
    takes the next expert when it is done with its last, so a worker that the OS deschedules
    (a shared machine) leaves its remaining experts to the others instead of holding up the
    join, as a fixed split would. Each worker owns its buffers; one expert's chunks run on one
    worker, in order (its weight gradients accumulate over them)."""
    workers = num_expert_workers(device, counts)
    if not workers:
        buffers = make_buffers(_buffer_rows(counts, max_rows))
        for e, s, t, first in chunks(counts, max_rows):
            body(e, s, t, first, buffers)
        return
    by_expert: dict[int, list] = {}
    for c in chunks(counts, max_rows):
        by_expert.setdefault(c[0], []).append(c)
    queue = iter(sorted(by_expert, key=lambda e: -counts[e]))
    lock = threading.Lock()
    buffer_rows = _buffer_rows(counts, max_rows)

    def run() -> None:
        buffers = None
        while True:
            with lock:
                e = next(queue, None)
            if e is None:
                return
            if buffers is None:
                buffers = make_buffers(buffer_rows)
            for _, s, t, first in by_expert[e]:
                body(e, s, t, first, buffers)
    run_on_workers([run] * workers)


def ffn_forward_blocks(num_rows: int, counts, w: FFNWeights, act: Activation,
                       x_rows: Callable, y_dest: Callable, y_done: Callable | None,
                       like: torch.Tensor, keep_hidden: bool = True,
                       max_rows: int | None = None):
    """Forward over blocks; x_rows(s, t) gives the block's input rows, y_dest(s, t, n) the
    buffer its output goes to (it may alias the block's input rows: they are read before the
    output is written), y_done(s, t, y) (optional) consumes it. Returns h1_RF, h3_RF, or
    (None, None) with keep_hidden=False (the hidden then lives in one block buffer only)."""
    hidden = w.w1_EDF.shape[2]
    work = work_dtype(like)
    glu = w.w3_EDF is not None
    h1_RF = like.new_empty(num_rows, hidden) if keep_hidden else None
    h3_RF = like.new_empty(num_rows, hidden) if keep_hidden and glu else None

    def make_buffers(n_buf: int) -> tuple:
        a_buf = like.new_empty(n_buf, hidden, dtype=work)
        h_bufs = (None, None) if keep_hidden else \
            (like.new_empty(n_buf, hidden), like.new_empty(n_buf, hidden) if glu else None)
        return a_buf, (a_buf.new_empty(n_buf, hidden) if work != like.dtype else None), h_bufs

    def body(e, s, t, first, buffers) -> None:
        a_buf, h32_buf, (h1_buf, h3_buf) = buffers
        n = t - s
        h1_NF = h1_RF[s:t] if keep_hidden else h1_buf[:n]
        x_ND = x_rows(s, t)
        mm_into(h1_NF, x_ND, w.w1_EDF[e], _pick(w.b1_EF, e))
        a_NF = _activate(act, h1_NF, None if h32_buf is None else h32_buf[:n], a_buf[:n])
        if glu:
            h3_NF = h3_RF[s:t] if keep_hidden else h3_buf[:n]
            mm_into(h3_NF, x_ND, w.w3_EDF[e])
            a_NF.mul_(h3_NF)
        y_ND = y_dest(s, t, n)
        mm_into(y_ND, a_NF, w.w2_EFD[e], _pick(w.b2_ED, e))
        if y_done is not None:
            y_done(s, t, y_ND)

    _run_chunks(counts, max_rows or chunk_rows(hidden), like.device, make_buffers, body)
    return h1_RF, h3_RF


def ffn_forward(x_RD: torch.Tensor, counts, w: FFNWeights, act: Activation):
    """Returns (y_RD, h1_RF, h3_RF or None)."""
    y_RD = x_RD.new_empty(x_RD.shape[0], w.w2_EFD.shape[2])
    work = work_dtype(x_RD)
    h1_RF, h3_RF = ffn_forward_blocks(x_RD.shape[0], counts, w, act,
                                      x_rows=lambda s, t: x_RD[s:t].to(work),
                                      y_dest=lambda s, t, n: y_RD[s:t], y_done=None, like=x_RD)
    return y_RD, h1_RF, h3_RF


GRAD_NAMES = ("w1_EDF", "w2_EFD", "w3_EDF", "b1_EF", "b2_ED")


def _empty_grad(param: torch.Tensor | None, counts, wanted: bool, name: str,
                pool: GradBuffers | None):
    """A stacked gradient buffer whose empty-expert slices are zero (the others get written):
    from `pool` (kept storage, grad_buffers.py) when given, else fresh."""
    if param is None or not wanted:
        return None
    grad = pool.take(name, param) if pool is not None else torch.empty_like(param)
    for e, n in enumerate(counts):
        if n == 0:
            grad[e].zero_()
    return grad


def _left_t(x_ND: torch.Tensor, scale_N1: torch.Tensor | None) -> torch.Tensor:
    """(scale * x)^T as a weight-gradient GEMM's left operand (x^T @ dh); copied contiguous
    for a native low-precision GEMM, whose transposed left operand costs 1.7-1.9x the time
    (oneDNN bf16, one thread, 2-core Xeon with AMX: 64 experts x 256 rows, D 512, F 2048:
    86.5 vs 47.3 ms with the copy; 16 x 512 rows, D 1024, F 4096: 124 vs 67 ms); fp32 GEMMs
    take the transposed view as fast. Scaled first, then copied: an elementwise op reading the
    transposed view runs ~3x as long as the two (2048 x 512 bf16: 2.9 vs 1.0 ms)."""
    xs_ND = x_ND if scale_N1 is None else x_ND * scale_N1
    if x_ND.dtype in (torch.bfloat16, torch.float16) and not needs_fp32_gemm(x_ND):
        return xs_ND.new_empty(xs_ND.shape[1], xs_ND.shape[0]).copy_(xs_ND.t())
    return xs_ND.t()


def _backward_elementwise(act: Activation, h1_BF, h3_BF, ga_BF, a1_BF, h32_BF, a_BF, dh3_BF,
                          dscale_B) -> None:
    """One block of rows of backward's elementwise work, in place: a1 = act(h1), a = a1 * h3
    (GLU, into a_BF), dscale = <ga, a>, dh3 = ga * a1 (GLU), then ga := dh1 = act'(h1) *
    (ga (* h3)). h32_BF: a work-dtype copy buffer for h1 when dtypes differ."""
    h1w_BF = h1_BF if h32_BF is None else h32_BF.copy_(h1_BF)
    act.forward_into(h1w_BF, a1_BF)
    a_BF = a1_BF if h3_BF is None else torch.mul(a1_BF, h3_BF, out=a_BF)
    if dscale_B is not None:    # vecdot: a multiply and a row sum (a 1 x F @ F x 1 bmm per
        dscale_B.copy_(torch.linalg.vecdot(ga_BF, a_BF))    # row: 3-5x as long on CPU)
    if h3_BF is not None:
        torch.mul(ga_BF, a1_BF, out=dh3_BF)
        ga_BF.mul_(h3_BF)
    act.backward_into(ga_BF, h1w_BF, ga_BF)


def ffn_backward_blocks(counts, w: FFNWeights, act: Activation, h1_RF, h3_RF,
                        x_rows: Callable, gy_rows: Callable, dx_dest: Callable | None,
                        dx_done: Callable | None, scale_R, need_dw: bool, *,
                        like: torch.Tensor | None = None, into: FFNWeights | None = None,
                        max_rows: int | None = None, release_hidden: bool = False,
                        grad_buffers: GradBuffers | None = None):
    """Backward over blocks. gy_rows(s, t) gives dL/d(scaled y) rows (unscaled by the score);
    dx_dest(s, t, n) the buffer for the block's input gradient (it may alias the block's gy or
    x rows: they are read before dx is written), dx_done(s, t, dx) consumes it.

    h1_RF None: the hidden is recomputed per block from x_rows (GEMM 1 again, into a block
    buffer of `like`'s dtype, exactly as ffn_forward_blocks computed it). `into`: weight
    gradients accumulate into these tensors (zeroed by the caller) instead of fresh ones;
    else they are written into tensors from `grad_buffers` (kept storage) or fresh ones.
    release_hidden: each block's rows of h1_RF / h3_RF go back to the kernel once the block is
    done with them (page_release; the caller checks `releasable` first).
    Returns (FFNWeights of grads or Nones, dscale_R fp32 or None)."""
    hidden = w.w1_EDF.shape[2]
    like = h1_RF if h1_RF is not None else like
    work = work_dtype(like)
    glu = w.w3_EDF is not None
    gw = into if into is not None else FFNWeights(
        *(_empty_grad(p, counts, need_dw, name, grad_buffers) for p, name in
          zip((w.w1_EDF, w.w2_EFD, w.w3_EDF, w.b1_EF, w.b2_ED), GRAD_NAMES)))
    dscale_R = None if scale_R is None else scale_R.new_zeros(
        scale_R.shape[0], dtype=torch.promote_types(scale_R.dtype, torch.float32))

    block = elementwise_rows(hidden, work)

    def make_buffers(n_buf: int) -> tuple:
        ga_buf = like.new_empty(n_buf, hidden, dtype=work)
        h_bufs = (None, None) if h1_RF is not None else \
            (like.new_empty(n_buf, hidden), like.new_empty(n_buf, hidden) if glu else None)
        return (ga_buf, torch.empty_like(ga_buf),
                (torch.empty_like(ga_buf), torch.empty_like(ga_buf)) if glu else (None, None),
                torch.empty_like(ga_buf) if work != like.dtype else None, h_bufs)

    def body(e, s, t, first, buffers) -> None:
        ga_buf, a1_buf, (a_buf, dh3_buf), h32_buf, (h1_buf, h3_buf) = buffers
        first = first and into is None
        n = t - s
        x_ND = x_rows(s, t)
        if h1_RF is None:                       # recompute GEMM 1 (and the gate's)
            h1_blk, h3_blk = h1_buf[:n], h3_buf[:n] if glu else None
            mm_into(h1_blk, x_ND, w.w1_EDF[e], _pick(w.b1_EF, e))
            if glu:
                mm_into(h3_blk, x_ND, w.w3_EDF[e])
        else:
            h1_blk, h3_blk = h1_RF[s:t], h3_RF[s:t] if glu else None
        gy_ND = gy_rows(s, t)
        ga_NF = ga_buf[:n]
        mm_into(ga_NF, gy_ND, w.w2_EFD[e].t())
        # the elementwise work, block by block of rows while they are in cache: a = act(h1)
        # (* h3), the score gradient <ga, a>, then ga becomes dh1 in place (and dh3 = ga * a1)
        a_NF = a_buf[:n] if glu else a1_buf[:n]
        dh3_NF = dh3_buf[:n] if glu else None
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            _backward_elementwise(
                act, h1_blk[b0:b1], None if h3_blk is None else h3_blk[b0:b1], ga_NF[b0:b1],
                a1_buf[b0:b1], None if h32_buf is None else h32_buf[b0:b1],
                a_NF[b0:b1] if glu else None, None if dh3_NF is None else dh3_NF[b0:b1],
                None if scale_R is None else dscale_R[s + b0:s + b1])
        dh1_NF = ga_NF
        if release_hidden and h1_RF is not None:    # the block's last read of h1 and h3
            release_rows(h1_blk)
            release_rows(h3_blk)
        scale_N1 = None
        if scale_R is not None:
            # ga stays unscaled: the score multiplies the N x D operands instead (gy for dW2
            # and b2, x for dW1/dW3/b1, dx at the end), a quarter of an N x F pass at F = 4D
            if w.b2_ED is not None:
                dscale_R[s:t] += gy_ND.to(dscale_R.dtype) @ w.b2_ED[e].to(dscale_R.dtype)
            scale_N1 = scale_R[s:t].to(work).unsqueeze(1)
            gy_ND = gy_ND * scale_N1
        if need_dw:
            mm_into(gw.w2_EFD[e], a_NF.t(), gy_ND, accumulate=not first)
            if gw.b2_ED is not None:
                _set_or_add(gw.b2_ED[e], gy_ND.sum(0), first)
            xT_DN = _left_t(x_ND, scale_N1)
            mm_into(gw.w1_EDF[e], xT_DN, dh1_NF, accumulate=not first)
            if gw.b1_EF is not None:
                db1_F = dh1_NF.sum(0) if scale_N1 is None else \
                    (dh1_NF * scale_N1).sum(0)
                _set_or_add(gw.b1_EF[e], db1_F, first)
            if glu:
                mm_into(gw.w3_EDF[e], xT_DN, dh3_NF, accumulate=not first)
        if dx_dest is not None:
            dx_ND = dx_dest(s, t, n)
            mm_into(dx_ND, dh1_NF, w.w1_EDF[e].t())
            if glu:
                mm_into(dx_ND, dh3_NF, w.w3_EDF[e].t(), accumulate=True)
            if scale_N1 is not None:
                dx_ND.mul_(scale_N1)
            if dx_done is not None:
                dx_done(s, t, dx_ND)

    _run_chunks(counts, max_rows or chunk_rows(hidden), like.device, make_buffers, body)
    return gw, dscale_R


def _set_or_add(dst: torch.Tensor, value: torch.Tensor, first: bool) -> None:
    if first:
        dst.copy_(value)
    else:
        dst.add_(value)


def ffn_backward(gy_RD, x_RD, h1_RF, h3_RF, counts, w: FFNWeights, act: Activation,
                 scale_R: torch.Tensor | None = None, need_dx: bool = True,
                 need_dw: bool = True, release_hidden: bool = False,
                 grad_buffers: GradBuffers | None = None):
    """Gradients of y_r = scale_r * ffn_e(x_r) given gy_RD = dL/d(scaled y) (unscaled rows).
    release_hidden, grad_buffers: as in ffn_backward_blocks.

    Returns (dx_RD, FFNWeights of grads (entries None when not wanted), dscale_R or None).
    """
    dx_RD = x_RD.new_empty(x_RD.shape) if need_dx else None
    work = work_dtype(x_RD)
    gw, dscale_R = ffn_backward_blocks(
        counts, w, act, h1_RF, h3_RF, x_rows=lambda s, t: x_RD[s:t].to(work),
        gy_rows=lambda s, t: gy_RD[s:t].to(work),
        dx_dest=(lambda s, t, n: dx_RD[s:t]) if need_dx else None, dx_done=None,
        scale_R=scale_R, need_dw=need_dw, release_hidden=release_hidden,
        grad_buffers=grad_buffers)
    if dscale_R is not None:
        dscale_R = dscale_R.to(scale_R.dtype)
    return dx_RD, gw, dscale_R
