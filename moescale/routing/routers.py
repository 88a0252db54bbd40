"""Routers: a gate projection plus a rule that picks k experts per token.

Every router maps `x_TD` to a `RouterOutput` holding the k scores and expert ids per token and
the full-softmax probabilities and logits that the balance and z losses need. Router math runs
in fp32 whatever the input precision (the gate is tiny; softmax in bf16 routes badly).
Randomness (noise, jitter, GShard's random second expert) is drawn from torch's RNG only while
training. Routers never touch torch.distributed and never build a dispatch mask.

Legend: T tokens, D model width, E experts, K experts per token.
An expert id of -1 marks a slot the router itself dropped (GShard's random routing).
Ties pick the lowest expert index (`top_k_lowest_index`), on every device: `torch.topk` leaves
tie order unspecified (on CPU it picks e.g. experts 6, 5 of 8 equal gates), and ties are common
(zero padding tokens, zero-initialised or upcycled gates, bf16-rounded inputs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moescale.routing.config import RouterConfig


class RouterOutput(NamedTuple):
    scores_TK: torch.Tensor      # fp32 weights of the chosen experts
    expert_ids_TK: torch.Tensor  # int64, -1 where the router dropped the slot
    logits_TE: torch.Tensor      # fp32 gate logits (z-loss)
    probs_TE: torch.Tensor       # fp32 softmax over all experts (balance loss)


def top_k_lowest_index(values_TE: torch.Tensor, k: int):
    """(values_TK, ids_TK): the k largest per row, descending, ties to the lowest index.

    k passes of `argmax` (documented to return the first maximal index), masking each pick;
    as fast as `torch.topk` for the small k of MoE routing.
    """
    ids_T1 = values_TE.detach().argmax(dim=-1, keepdim=True)
    picks = [ids_T1]
    if k > 1:
        masked_TE = values_TE.detach().clone()
        for _ in range(k - 1):
            masked_TE.scatter_(1, picks[-1], float("-inf"))
            picks.append(masked_TE.argmax(dim=-1, keepdim=True))
    ids_TK = torch.cat(picks, dim=1) if k > 1 else ids_T1
    return values_TE.gather(1, ids_TK), ids_TK


# Bytes per fp32 block when a low-precision input is upcast block by block: a whole T x D fp32
# copy is a fresh allocation whose first write faults page by page on a CPU (~0.55 ms per MiB
# on a 2-core EPYC VM); blocks this size are reused from the heap. Gate forward + backward at
# T = 8192, D = 512, E = 64, bf16: 18.9 -> 15.2 ms (best of 21 each, interleaved).
UPCAST_BLOCK_BYTES = 2 << 20


def _upcast_blocks(x_TD: torch.Tensor):
    """(start, stop) row ranges whose fp32 copies are about UPCAST_BLOCK_BYTES each."""
    step = max(1, UPCAST_BLOCK_BYTES // (4 * max(x_TD.shape[1], 1)))
    return [(s, min(s + step, x_TD.shape[0])) for s in range(0, x_TD.shape[0], step)]


class GateLogits(torch.autograd.Function):
    """logits_TE = x_TD @ w_ED^T computed in fp32, saving x_TD in its own precision.

    `x_TD.float() @ w.float().t()` in autograd would save the fp32 copy of a bf16 input for
    backward (2x the input's bytes); this keeps the input itself and upcasts again in backward.
    A low-precision input on a CPU is upcast block by block (`_upcast_blocks`), never whole:
    the same fp32 GEMMs, without a fresh T x D fp32 buffer per pass.
    """

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        w32_DE = w_ED.float().t()
        if x_TD.dtype == torch.float32 or x_TD.device.type != "cpu":
            return x_TD.float() @ w32_DE
        logits_TE = x_TD.new_empty(x_TD.shape[0], w_ED.shape[0], dtype=torch.float32)
        for s, t in _upcast_blocks(x_TD):
            torch.mm(x_TD[s:t].float(), w32_DE, out=logits_TE[s:t])
        return logits_TE

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w_ED = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w32_ED = w_ED.float()
        if x_TD.dtype == torch.float32 or x_TD.device.type != "cpu":
            dx_TD = (g_TE @ w32_ED).to(x_TD.dtype) if need_dx else None
            dw_ED = (g_TE.t() @ x_TD.float()).to(w_ED.dtype) if need_dw else None
            return dx_TD, dw_ED
        dx_TD = torch.empty_like(x_TD) if need_dx else None
        dw32_ED = w32_ED.new_zeros(w_ED.shape) if need_dw else None
        for s, t in _upcast_blocks(x_TD):
            if need_dx:
                dx_TD[s:t] = g_TE[s:t] @ w32_ED
            if need_dw:
                dw32_ED.addmm_(g_TE[s:t].t(), x_TD[s:t].float())
        return dx_TD, None if dw32_ED is None else dw32_ED.to(w_ED.dtype)


class Router(nn.Module):
    """Gate projection `D -> E` (no bias) and the routing rule named by `config.kind`."""

    def __init__(self, d_model: int, config: RouterConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.d_model = d_model
        self.weight = nn.Parameter(torch.empty(config.num_experts, d_model, device=device,
                                               dtype=dtype))
        if config.kind == "noisy_topk":
            self.noise_weight = nn.Parameter(torch.zeros(config.num_experts, d_model,
                                                         device=device, dtype=dtype))
        else:
            self.register_parameter("noise_weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.d_model ** -0.5)
        if self.noise_weight is not None:
            nn.init.zeros_(self.noise_weight)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg = self.config
        with torch.autocast(x_TD.device.type, enabled=False):
            x_in_TD = x_TD
            if cfg.kind == "switch" and self.training and cfg.jitter_eps > 0:
                jitter_TD = torch.empty(x_TD.shape, device=x_TD.device).uniform_(
                    1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
                x_in_TD = x_TD.float() * jitter_TD
            logits_TE = GateLogits.apply(x_in_TD, self.weight)
            probs_TE = torch.softmax(logits_TE, dim=-1)
            if cfg.kind == "noisy_topk":
                scores_TK, ids_TK = self._noisy_topk(x_in_TD, logits_TE)
            elif cfg.kind == "gshard":
                scores_TK, ids_TK = self._gshard(probs_TE)
            else:
                scores_TK, ids_TK = top_k_lowest_index(probs_TE, cfg.top_k)
                if cfg.renormalize_scores:
                    scores_TK = scores_TK / scores_TK.sum(-1, keepdim=True)
        return RouterOutput(scores_TK, ids_TK, logits_TE, probs_TE)

    def _noisy_topk(self, x_TD: torch.Tensor, logits_TE: torch.Tensor):
        cfg = self.config
        noisy_TE = logits_TE
        if self.training:
            std_TE = F.softplus(GateLogits.apply(x_TD, self.noise_weight)) + cfg.noise_std_min
            noisy_TE = logits_TE + torch.randn_like(logits_TE) * std_TE
        top_TK, ids_TK = top_k_lowest_index(noisy_TE, cfg.top_k)
        return torch.softmax(top_TK, dim=-1), ids_TK

    def _gshard(self, probs_TE: torch.Tensor):
        cfg = self.config
        scores_TK, ids_TK = top_k_lowest_index(probs_TE, 2)
        if cfg.renormalize_scores:
            scores_TK = scores_TK / scores_TK.sum(-1, keepdim=True)
        if self.training and cfg.random_routing:
            draw_T = torch.rand_like(scores_TK[:, 1])
            keep2_T = draw_T < 2.0 * scores_TK[:, 1].detach()
            ids_TK = torch.stack([ids_TK[:, 0], torch.where(keep2_T, ids_TK[:, 1], -1)], dim=1)
            scores_TK = torch.stack([scores_TK[:, 0], scores_TK[:, 1] * keep2_T], dim=1)
        return scores_TK, ids_TK
