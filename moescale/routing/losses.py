"""Auxiliary router losses: load balance (canonical scale) and router z-loss.

balance = E * sum_e f_e * P_e, where f_e is the fraction of the T*K routing choices that picked
expert e (before capacity drops, as in Switch/GShard) and P_e the mean softmax probability of e.
A perfectly uniform router scores exactly 1.0. The statistics may be summed over an
expert-parallel group by the caller-provided `reduce_sum` (identity on one process); this file
never calls torch.distributed itself.

z = mean_t logsumexp(logits_t)^2 (ST-MoE), which keeps gate logits small.
"""

from __future__ import annotations

from typing import Callable

import torch


def balance_loss(probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor,
                 reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """E * sum_e f_e * P_e over the (optionally group-reduced) batch."""
    num_tokens, num_experts = probs_TE.shape
    valid_F = expert_ids_TK.reshape(-1)
    valid_F = valid_F[valid_F >= 0]
    choices_E = torch.bincount(valid_F, minlength=num_experts).to(probs_TE.dtype)
    stats = torch.cat([choices_E, probs_TE.sum(0),
                       probs_TE.new_tensor([float(num_tokens), float(valid_F.numel())])])
    if reduce_sum is not None:
        stats = reduce_sum(stats)
    choices_E, prob_sum_E, totals = stats[:num_experts], stats[num_experts:-2], stats[-2:]
    f_E = choices_E / totals[1].clamp_min(1.0)
    p_E = prob_sum_E / totals[0].clamp_min(1.0)
    return num_experts * (f_E * p_E).sum()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Mean squared log-partition of the gate logits."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
