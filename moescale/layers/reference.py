"""The slow, obviously-correct MoE: the oracle every fast path is tested against.

`ReferenceMoE(moe)` shares `moe`'s parameters (nothing is copied) and recomputes the same layer
with dense masks and Python loops: routing by dense softmax and argmax, capacity by walking
choices in priority order, every expert applied to every token and masked. It draws its random
numbers (switch jitter, noisy-top-k noise, GShard's random routing) in the same order and shapes
as the fast router, so with the same seed it routes identically while training too.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moescale.routing.config import expert_capacity


class ReferenceMoE(nn.Module):
    """Recomputes `moe(x)` slowly; `last_aux_loss` matches `moe.last_aux_loss`."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.last_aux_loss: torch.Tensor | None = None
        self.last_keep_TK: torch.Tensor | None = None

    def route(self, x_TD: torch.Tensor):
        """(scores_TK, ids_TK, logits_TE, probs_TE) by dense operations, in fp32."""
        router, cfg = self.moe.router, self.moe.config.router
        training = self.moe.training
        with torch.autocast(x_TD.device.type, enabled=False):
            xr_TD = x_TD.float()
            if cfg.kind == "switch" and training and cfg.jitter_eps > 0:
                xr_TD = xr_TD * torch.empty_like(xr_TD).uniform_(1 - cfg.jitter_eps,
                                                                 1 + cfg.jitter_eps)
            logits_TE = xr_TD @ router.weight.float().t()
            probs_TE = torch.softmax(logits_TE, dim=-1)
            if cfg.kind == "noisy_topk":
                noisy_TE = logits_TE
                if training:
                    std_TE = F.softplus(xr_TD @ router.noise_weight.float().t()) + cfg.noise_std_min
                    noisy_TE = logits_TE + torch.randn_like(logits_TE) * std_TE
                ids_TK = self._argmax_k(noisy_TE, cfg.top_k)
                scores_TK = torch.softmax(torch.gather(noisy_TE, 1, ids_TK), dim=-1)
                return scores_TK, ids_TK, logits_TE, probs_TE
            ids_TK = self._argmax_k(probs_TE, cfg.top_k)
            scores_TK = torch.gather(probs_TE, 1, ids_TK)
            if cfg.renormalize_scores:
                scores_TK = scores_TK / scores_TK.sum(-1, keepdim=True)
            if cfg.kind == "gshard" and training and cfg.random_routing:
                keep2_T = torch.rand_like(scores_TK[:, 1]) < 2.0 * scores_TK[:, 1].detach()
                ids_TK = ids_TK.clone()
                ids_TK[~keep2_T, 1] = -1
                scores_TK = scores_TK * torch.stack([torch.ones_like(keep2_T), keep2_T], 1)
        return scores_TK, ids_TK, logits_TE, probs_TE

    @staticmethod
    def _argmax_k(values_TE: torch.Tensor, k: int) -> torch.Tensor:
        """The k largest per row, one argmax at a time (masking the ones taken)."""
        masked_TE = values_TE.detach().clone()
        picks = []
        for _ in range(k):
            pick_T = masked_TE.argmax(dim=-1)
            picks.append(pick_T)
            masked_TE[torch.arange(masked_TE.shape[0]), pick_T] = float("-inf")
        return torch.stack(picks, dim=1) if picks else values_TE.new_zeros(0, 0).long()

    def keep_mask(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """Capacity by position priority: all first choices in token order, then seconds..."""
        cfg = self.moe.config
        num_tokens, top_k = ids_TK.shape
        capacity = expert_capacity(cfg.capacity_factor, num_tokens, top_k, cfg.num_experts)
        keep_TK = ids_TK >= 0
        if capacity is None:
            return keep_TK
        used = [0] * cfg.num_experts
        ids = ids_TK.tolist()
        for k in range(top_k):
            for t in range(num_tokens):
                e = ids[t][k]
                if e < 0:
                    continue
                if used[e] < capacity:
                    used[e] += 1
                else:
                    keep_TK[t, k] = False
        return keep_TK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, cfg = self.moe, self.moe.config
        x_TD = x.reshape(-1, cfg.d_model)
        scores_TK, ids_TK, logits_TE, probs_TE = self.route(x_TD)
        keep_TK = self.keep_mask(ids_TK)
        self.last_keep_TK = keep_TK
        y_TD = None
        for e in range(cfg.num_experts):
            weight_T = ((ids_TK == e) & keep_TK).to(scores_TK.dtype).mul(scores_TK).sum(1)
            out_TD = moe.experts.expert_forward(e, x_TD)
            term_TD = weight_T.to(out_TD.dtype).unsqueeze(1) * out_TD
            y_TD = term_TD if y_TD is None else y_TD + term_TD
        valid_TK = ids_TK >= 0
        one_hot_TKE = F.one_hot(ids_TK.clamp_min(0), cfg.num_experts) * valid_TK.unsqueeze(-1)
        f_E = one_hot_TKE.sum((0, 1)).float() / valid_TK.sum().clamp_min(1)
        p_E = probs_TE.sum(0) / max(x_TD.shape[0], 1)
        balance = cfg.num_experts * (f_E * p_E).sum()
        z = torch.logsumexp(logits_TE, -1).square().mean() if x_TD.shape[0] else balance * 0
        self.last_aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        return y_TD.reshape(x.shape[:-1] + (y_TD.shape[-1],))
