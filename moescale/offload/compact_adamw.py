"""One expert's AdamW on compact state (state_format.py), as the host optimizer's workers run it.

With int8 moments and the C loop built, the update is moescale's own AdamW, defined by
`adamw_reference` (torch ops, every operation rounded on its own, in this order):

    p = p * (1 - lr wd)
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p - (m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps)) * (lr / (1 - beta1^t))

where sqrt is correctly rounded to fp32 (computed in double; torch's fp32 sqrt is not always),
which is torch.optim.AdamW's formula (within 1e-5 relative of its fused kernel's rounding:
tests/offload/test_state_format.py). Where a C compiler built codec_kernels.py, an expert with
int8 moments steps by this formula with the decode and encode in one pass over each 256-number
block (`adamw_int8`), bitwise `step_reference` (decode, `adamw_reference`, encode:
tests/offload/test_codec_kernels.py): the several passes of decode, AdamW and encode over a
chunk were 28 of the 37 ms of one expert's step (`moescale bench compact-optimizer`), and that
CPU bounded a 2-core machine's step past RAM. Without a compiler, and for fp32 and bf16 moments, the codec decodes chunk by chunk and
torch's fused AdamW steps (`adamw_reference` in torch ops is twice as slow: a correctly
rounded sqrt needs a pass in double). The two paths agree to rounding, not bitwise: a run
resumes bitwise on a machine of the same kind; a checkpoint moved between a machine with a
compiler and one without continues with differences of an ulp.

Deliberately not here: the worker threads, fences and the step guard (optimizer.py), the record
layout and the codes (state_format.py, int8_codes.py).
"""

from __future__ import annotations

import math

import torch

from moescale.offload.int8_codes import BLOCK
from moescale.offload.state_format import NOISE_NUMBERS, StateCodec


def adamw_hparams(hp: dict, t: int) -> torch.Tensor:
    """fp32 [8]: (1 - lr wd, beta1, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t),
    1 / sqrt(1 - beta2^t), eps) for step t (the step being taken, 1-based), each computed in
    double and rounded once (a reciprocal, not a divisor: torch divides a tensor by a number
    as a multiplication by its reciprocal, so the formula says so)."""
    b1, b2 = hp["betas"]
    return torch.tensor([1 - hp["lr"] * hp["weight_decay"], b1, 1 - b1, b2, 1 - b2,
                         hp["lr"] / (1 - b1 ** t), 1 / math.sqrt(1 - b2 ** t), hp["eps"]],
                        dtype=torch.float64).float()


def adamw_reference(master_C: torch.Tensor, grad_C: torch.Tensor, exp_avg_C: torch.Tensor,
                    exp_avg_sq_C: torch.Tensor, hp_8: torch.Tensor) -> None:
    """The compact AdamW update on fp32 tensors, in place (the module docstring's formula)."""
    decay, b1, c1, b2, c2, step_size, inv_bc2_sqrt, eps = (float(x) for x in hp_8)
    master_C.mul_(decay)
    exp_avg_C.mul_(b1).add_(grad_C * c1)
    exp_avg_sq_C.mul_(b2).add_((grad_C * grad_C).mul_(c2))
    denom_C = exp_avg_sq_C.double().sqrt_().float().mul_(inv_bc2_sqrt).add_(eps)  # sqrt
    # correctly rounded (torch's fp32 sqrt is within half an ulp and a hair: not always)
    master_C.sub_(torch.div(exp_avg_C, denom_C).mul_(step_size))


def step_compact(codec: StateCodec, rows: tuple[torch.Tensor, ...], grad_P: torch.Tensor,
                 numel: int, where: tuple[int, int, int], hp: dict, torch_adamw) -> None:
    """One expert's step on compact rows (master, exp_avg, exp_avg_sq as the store keeps them)
    with its gradient grad_P; where = (layer, global expert, step t being taken). torch_adamw:
    the callable running torch's AdamW on fp32 lists (fp32 and bf16 moments)."""
    master, exp_avg, exp_avg_sq = rows
    t = where[2]
    if codec.fmt.moments != "int8" or codec.kernels is None:
        count_t = torch.zeros(())
        for lo, hi, master_C, exp_avg_C, exp_avg_sq_C in codec.chunks(*rows, numel, where):
            torch_adamw([master_C], [grad_P[lo:hi]], [exp_avg_C], [exp_avg_sq_C],
                        [count_t.fill_(t - 1)])
        return
    hp_8 = adamw_hparams(hp, t)
    m_codes, m_scale = codec.int8_parts(exp_avg, numel, 0, numel)
    v_codes, v_scale = codec.int8_parts(exp_avg_sq, numel, 0, numel)
    for lo in range(0, numel, NOISE_NUMBERS):      # the rounding noise is read per part
        hi = min(numel, lo + NOISE_NUMBERS)
        noise = codec.noise(where, lo, hi) if codec.fmt.master == "bf16" else None
        codec.kernels.adamw_int8(master[lo:hi], noise, grad_P[lo:hi], hi - lo,
                                 (m_codes[lo:], m_scale[lo // BLOCK:]),
                                 (v_codes[lo:], v_scale[lo // BLOCK:]), hp_8)


def step_reference(codec: StateCodec, rows: tuple[torch.Tensor, ...], grad_P: torch.Tensor,
                   numel: int, where: tuple[int, int, int], hp: dict) -> None:
    """What the C loop computes, in torch ops (for tests): decode chunk by chunk,
    `adamw_reference`, encode."""
    hp_8 = adamw_hparams(hp, where[2])
    for lo, hi, master_C, exp_avg_C, exp_avg_sq_C in codec.chunks(*rows, numel, where):
        adamw_reference(master_C, grad_P[lo:hi], exp_avg_C, exp_avg_sq_C, hp_8)
