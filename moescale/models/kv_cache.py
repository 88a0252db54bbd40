"""KVCache: the keys and values of a GPT's past tokens, so that decoding runs one token per forward.

`GPT.generate` prefills the cache with the prompt (one forward over it, exactly the full
forward's math), then feeds one new token per forward: its query attends to the cached keys and
values of every earlier position, so each generated token costs one token's attention
projections, one row of attention and, in every MoE layer, the top-k experts of one token (an
offloaded model fetches only those).

Layout: per layer, `k_BGCK` and `v_BGCK` of shape [batch, n_kv_heads, capacity, head_dim],
allocated at the first write in the dtype the attention produces (autocast's), filled up to
`length`. Keys are stored after the rotary rotation (their positions never change while cached)
and before grouped-query expansion (n_kv_heads, not n_heads: the cache of a GQA model is
n_heads / n_kv_heads times smaller).

The context window: a GPT attends to at most `seq_len` positions (its rotary table and training
never saw more). When the cache is full, `GPT.generate` keeps the newest `seq_len // 2` tokens
and prefills them again from position 0 (a "context shift"): positions restart as they do in a
full recompute of the newest window, and the cost of a re-prefill is spread over the next
seq_len // 2 tokens. Within the window this equals today's sliding-window recompute exactly;
past it each token sees between seq_len // 2 and seq_len - 1 earlier tokens instead of always
seq_len - 1 (a full recompute of every window would cost a prefill per token).

Legend: B batch, G key/value heads, C cache capacity (seq_len), K head width, S new tokens.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value tensors of the positions 0..length-1 of a batch of sequences."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        if n_layers < 1 or capacity < 1:
            raise ValueError(f"n_layers={n_layers} and capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.k_BGCK: list[torch.Tensor | None] = [None] * n_layers
        self.v_BGCK: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0          # positions cached (the same in every layer after a forward)

    def reset(self) -> None:
        """Forget every position (the tensors are kept for the next prefill)."""
        self.length = 0

    def room(self) -> int:
        return self.capacity - self.length

    def append(self, layer: int, k_BGSK: torch.Tensor, v_BGSK: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values of `layer` after the cached ones; returns
        views of every cached position's keys and values (the new ones included). The caller
        advances `length` once all layers are written (`advance`)."""
        B, G, S, K = k_BGSK.shape
        end = self.length + S
        if end > self.capacity:
            raise ValueError(f"{S} new positions after {self.length} exceed the cache's "
                             f"capacity of {self.capacity} (the model's seq_len); shift the "
                             "context (GPT.generate does) or start a new cache")
        k = self.k_BGCK[layer]
        if k is None or k.shape[0] != B or k.dtype != k_BGSK.dtype or k.device != k_BGSK.device:
            if self.length:
                raise ValueError(f"layer {layer}: new keys of batch {B} / {k_BGSK.dtype} do "
                                 f"not fit the cached ones of batch "
                                 f"{None if k is None else k.shape[0]}; reset the cache first")
            shape = (B, G, self.capacity, K)
            self.k_BGCK[layer] = k_BGSK.new_empty(shape)
            self.v_BGCK[layer] = v_BGSK.new_empty(shape)
        self.k_BGCK[layer][:, :, self.length:end] = k_BGSK
        self.v_BGCK[layer][:, :, self.length:end] = v_BGSK
        return self.k_BGCK[layer][:, :, :end], self.v_BGCK[layer][:, :, :end]

    def advance(self, new_positions: int) -> None:
        self.length += new_positions

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_BGCK + self.v_BGCK
                   if t is not None)


def causal_mask(past: int, new: int, device) -> torch.Tensor | None:
    """SDPA's boolean mask [new, past + new] for new queries after `past` cached positions
    (query i sees keys 0..past + i); None when every query sees every key (one new token)."""
    if new == 1:
        return None
    keys_K = torch.arange(past + new, device=device)
    return keys_K[None, :] <= (past + torch.arange(new, device=device))[:, None]
