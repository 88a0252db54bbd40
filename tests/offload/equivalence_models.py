"""Shared helpers for the offloading tests: a tiny MoE language model and a training loop that
runs it all-resident (torch.optim.AdamW) or offloaded (offload_moe), returning the losses."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from moescale import MoE, collect_aux_loss
from moescale.offload import OffloadConfig, offload_moe

VOCAB, SEQ, BATCH = 48, 8, 2


class TinyMoEModel(nn.Module):
    """Embedding -> 2 x (residual MoE) -> head: the fallback when the GPT model is absent."""

    def __init__(self, d_model=16, num_experts=4, glu=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.moes = nn.ModuleList(MoE(d_model, num_experts, 2, d_ff=2 * d_model, glu=glu)
                                  for _ in range(2))
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for moe in self.moes:
            x = x + moe(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return logits, loss + collect_aux_loss(self)


def make_model(seed=0, glu=False) -> nn.Module:
    torch.manual_seed(seed)
    try:
        from moescale.models.gpt import GPT, GPTConfig
    except ImportError:
        return TinyMoEModel(glu=glu)
    return GPT(GPTConfig.from_flat(vocab_size=VOCAB, seq_len=SEQ, n_layers=2, d_model=16,
                                   n_heads=2, d_ff=32, num_experts=4, top_k=2, glu=glu,
                                   init_std=0.1))


def batches(step: int, accum: int):
    gen = torch.Generator().manual_seed(1000 + step)
    for _ in range(accum):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        yield idx, torch.roll(idx, -1, dims=1)


def train(model: nn.Module, steps: int, accum: int, offload: OffloadConfig | None = None,
          clip: float | None = None, lr: float = 3e-2):
    """Losses per step (mean over micro-batches) of AdamW training; offloaded if asked."""
    model = copy.deepcopy(model)
    engine = offload_moe(model, offload) if offload is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    if engine is not None:
        engine.follow(opt)
    losses = []
    try:
        for step in range(steps):
            total = 0.0
            for i, (idx, tgt) in enumerate(batches(step, accum)):
                if engine is not None:
                    engine.begin_micro_batch(last=i == accum - 1)
                _, loss = model(idx, tgt)
                (loss / accum).backward()
                total += loss.item() / accum
            if clip is not None:
                if engine is not None:
                    engine.clip_grad_norm_(model.parameters(), clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if engine is not None:
                engine.step()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(total)
        if engine is not None:
            engine.synchronize()
    finally:
        if engine is not None:
            engine.close()
    return losses, model, engine
