"""A GPT-style decoder-only language model whose feed-forward blocks are moescale MoE layers.

Architecture (pre-norm): token embedding -> n_layers x [RMSNorm -> causal self-attention with
rotary position embeddings (through `F.scaled_dot_product_attention(is_causal=True)`;
multi-head, or grouped-query with `n_kv_heads` < n_heads, as Mixtral's) -> residual; RMSNorm -> FFN -> residual] -> final RMSNorm -> LM head (optionally tied to the
embedding). The FFN of layer i is an `moescale.MoE` when `config.is_moe_layer(i)` (every layer
for `moe_every=1`, every other layer for `moe_every=2`, layers 1, 3, 5, ... as in GShard and
Switch) and a dense FFN of the same shape otherwise.

`model(idx_BS, targets_BS=None) -> (logits_BSV, loss)`: loss is the mean token cross-entropy
(ignore_index=-100) plus `collect_aux_loss(model)`, the weighted router losses of this call;
`model.last_loss_parts` keeps both parts detached for logging. `num_parameters()` gives total
and active-per-token counts; `count_parameters(config)` does it on the meta device without
allocating anything; `generate()` samples continuations with a KV cache (kv_cache.py): one
forward over the prompt, then one token per forward (`forward_cached`), the same tokens as a
full recompute of the window per token (which it falls back to when a layer drops tokens by
capacity: a token's experts then depend on the other tokens of the forward).

Deliberately not here: tensor parallelism, fused kernels, learned absolute position
embeddings (rotary only), training loops and data (moescale.train), named sizes (sizes.py),
expert streaming and generation statistics (moescale.train.streamed, moescale.train.gen_stats).

Legend: B batch, S sequence, D model width, H heads, Dh head width, V vocabulary, T = B*S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moescale.config_tree import FlatKeys
from moescale.layers.activations import ACTIVATIONS, Activation
from moescale.layers.experts import GroupedExperts
from moescale.layers.moe import MoE, MoEConfig, collect_aux_loss
from moescale.models.kv_cache import KVCache, causal_mask


@dataclass(kw_only=True)
class GPTConfig(FlatKeys):
    """Plain-data description of a GPT MoE language model (validated on construction).

    The transformer's own fields here; the FFN's (expert width d_ff, activation, glu, capacity,
    loss weights, and inside it the router with num_experts and top_k) in `moe`, the
    `moescale.MoE` config every MoE layer is built from (a dense FFN layer takes its d_ff,
    activation and glu). `moe` None: the default MoEConfig at this d_model and bias.
    Built nested, or from flat keys as a size's overrides are: `GPTConfig.from_flat(d_model=64,
    num_experts=4, top_k=1, router="switch")` (moescale.config_tree; `to_flat()` is the way
    back).

    moe_every: 1 puts an MoE FFN in every layer, 2 in every other layer (layers 1, 3, ...),
        n in layers n-1, 2n-1, ...; 0 builds a fully dense model (a baseline).
    bias: biases on every projection, attention and FFN (moe.bias must agree).
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None     # grouped-query attention (None: n_heads, multi-head)
    moe_every: int = 1
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = False
    qkv_bias: bool = False        # biases on the q/k/v projections only (Qwen2)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.moe is None:
            self.moe = MoEConfig(d_model=self.d_model, bias=self.bias)
        moe = self.moe
        for name in ("d_model", "bias"):
            if getattr(moe, name) != getattr(self, name):
                raise ValueError(f"moe.{name}={getattr(moe, name)!r} differs from {name}="
                                 f"{getattr(self, name)!r}; the MoE layers take the model's "
                                 f"{name}: build moe with {name}={getattr(self, name)!r}")
        for name in ("num_experts", "top_k", "d_ff"):
            value = getattr(moe, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer"
                                 + (" or None (None means 4 * d_model)" if name == "d_ff"
                                    else ""))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1 \
                or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads!r} must be a positive integer "
                             f"dividing n_heads={self.n_heads} (None: n_heads)")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads="
                             f"{self.n_heads}; pick n_heads dividing d_model")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head width d_model/n_heads={self.d_model // self.n_heads} must be "
                             "even for rotary embeddings; change d_model or n_heads")
        if not isinstance(self.moe_every, int) or self.moe_every < 0:
            raise ValueError(f"moe_every={self.moe_every!r} must be an integer >= 0 "
                             "(1: every layer, 2: every other layer, 0: dense model)")
        if moe.activation not in ACTIVATIONS:
            raise ValueError(f"activation={moe.activation!r} is unknown; use one of "
                             f"{', '.join(ACTIVATIONS)}")
        if moe.glu and self.bias:
            raise ValueError("glu=True with bias=True is not supported (GLU experts are "
                             "bias-free); set bias=False")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must lie in [0, 1)")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has an MoE FFN."""
        return self.moe_every > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


class ParamCount(NamedTuple):
    total: int    # every parameter once (a tied embedding counts once)
    active: int   # parameters one token touches: top_k of the num_experts experts per MoE layer
    expert: int   # parameters inside experts (the part offloading moves)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SR, sin_SR (R = head_dim / 2) in fp32 for positions 0..seq_len-1."""
    inv_freq_R = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                           / head_dim)
    angle_SR = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq_R
    return angle_SR.cos(), angle_SR.sin()


def apply_rotary(x_BHSK: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor
                 ) -> torch.Tensor:
    """Rotate pairs (x[..., r], x[..., r + R]) by position angles (the half-split convention)."""
    half = x_BHSK.shape[-1] // 2
    x1, x2 = x_BHSK[..., :half].float(), x_BHSK[..., half:].float()
    out = torch.cat([x1 * cos_SR - x2 * sin_SR, x2 * cos_SR + x1 * sin_SR], dim=-1)
    return out.to(x_BHSK.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout = cfg.n_heads, cfg.head_dim, cfg.dropout
        self.n_kv_heads = cfg.n_kv_heads
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
                             bias=cfg.bias or cfg.qkv_bias)  # rows: q (H heads), k, v (G each)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x_BSD: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """Causal attention over x's positions; with `cache`, x holds the positions after the
        cached ones (cos/sin theirs): their keys and values are cached, queries see all."""
        if cache is not None:
            return self._cached(x_BSD, cos_SR, sin_SR, cache, layer)
        B, S, D = x_BSD.shape
        H, G, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if G == H:
            qkv = self.qkv(x_BSD).view(B, S, 3, H, Dh).permute(2, 0, 3, 1, 4)
            q_BHSK, k_BHSK, v_BHSK = qkv.unbind(0)
        else:        # grouped-query: query head h reads key/value head h // (H / G)
            q, k, v = self.qkv(x_BSD).split([H * Dh, G * Dh, G * Dh], dim=-1)
            q_BHSK = q.view(B, S, H, Dh).transpose(1, 2)
            k_BHSK, v_BHSK = (t.view(B, S, G, Dh).transpose(1, 2).repeat_interleave(H // G, 1)
                              for t in (k, v))
        q_BHSK = apply_rotary(q_BHSK, cos_SR, sin_SR)
        k_BHSK = apply_rotary(k_BHSK, cos_SR, sin_SR)
        o_BHSK = F.scaled_dot_product_attention(
            q_BHSK, k_BHSK, v_BHSK, is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        return self.proj(o_BHSK.transpose(1, 2).reshape(B, S, D))

    def _cached(self, x_BSD, cos_SR, sin_SR, cache: KVCache, layer: int) -> torch.Tensor:
        B, S, D = x_BSD.shape
        H, G, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x_BSD).split([H * Dh, G * Dh, G * Dh], dim=-1)
        q_BHSK = apply_rotary(q.view(B, S, H, Dh).transpose(1, 2), cos_SR, sin_SR)
        k_BGSK = apply_rotary(k.view(B, S, G, Dh).transpose(1, 2), cos_SR, sin_SR)
        past = cache.length
        k_BGCK, v_BGCK = cache.append(layer, k_BGSK, v.view(B, S, G, Dh).transpose(1, 2))
        if G != H:      # query head h reads key/value head h // (H / G)
            k_BGCK, v_BGCK = (t.repeat_interleave(H // G, 1) for t in (k_BGCK, v_BGCK))
        if past == 0:   # a prefill: the full forward's call
            o_BHSK = F.scaled_dot_product_attention(q_BHSK, k_BGCK, v_BGCK, is_causal=True)
        else:
            o_BHSK = F.scaled_dot_product_attention(
                q_BHSK, k_BGCK, v_BGCK, attn_mask=causal_mask(past, S, x_BSD.device))
        return self.proj(o_BHSK.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    """One expert's math as a dense block: act(x W1 + b1) W2 + b2, or (act(x W1) * x W3) W2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        ffn = cfg.moe
        self.act = Activation(ffn.activation)
        self.w1 = nn.Linear(cfg.d_model, ffn.d_ff, bias=ffn.bias)
        self.w3 = nn.Linear(cfg.d_model, ffn.d_ff, bias=False) if ffn.glu else None
        self.w2 = nn.Linear(ffn.d_ff, cfg.d_model, bias=ffn.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act.forward(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        return self.w2(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, expert_device=None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.ffn = MoE(config=cfg.moe, expert_device=expert_device)
        else:
            self.ffn = DenseFFN(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BSD, cos_SR, sin_SR, cache: KVCache | None = None, layer: int = 0):
        x_BSD = x_BSD + self.drop(self.attn(self.attn_norm(x_BSD), cos_SR, sin_SR, cache,
                                            layer))
        return x_BSD + self.drop(self.ffn(self.ffn_norm(x_BSD)))


class GPT(nn.Module):
    """Decoder-only MoE language model; see the module docstring."""

    def __init__(self, config: GPTConfig, expert_device=None) -> None:
        """expert_device="meta": the MoE layers' stacked experts take no memory; offload them
        with offload_moe(model, ..., expert_init=model.expert_init), which gives them the values
        a materialised build would have."""
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}; build "
                             "one with GPTConfig(...) or moescale.models.gpt_config(name)")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i, expert_device)
                                    for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.last_loss_parts: dict[str, torch.Tensor] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std); output projections scaled by 1/sqrt(2 n_layers)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_out = name.endswith(("attn.proj", "ffn.w2"))
                nn.init.normal_(module.weight, std=out_std if is_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, GroupedExperts):
                module.init_(self.expert_std())

    def expert_std(self) -> dict[str, float]:
        """Standard deviations of the expert weights' normal init (biases zero)."""
        std = self.config.init_std
        return {"w1_EDF": std, "w3_EDF": std, "w2_EFD": std / math.sqrt(2 * self.config.n_layers)}

    def expert_init(self, layer: int, e: int, layout) -> torch.Tensor:
        """Expert e of the layer-th MoE layer's initial values, flat in `layout` order: the
        `expert_init` of offload_moe for a model built with expert_device="meta"."""
        experts = [m for m in self.modules() if isinstance(m, MoE)][layer].experts
        values = experts.init_values(e, self.expert_std())
        return torch.cat([values[name].reshape(-1) for name in layout.names])

    def forward(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor | None = None):
        cfg = self.config
        if idx_BS.dim() != 2 or idx_BS.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx has shape {tuple(idx_BS.shape)} and dtype {idx_BS.dtype}; "
                             "it must be integer token ids of shape [batch, seq]")
        S = idx_BS.shape[1]
        if S > cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds seq_len={cfg.seq_len}; crop the "
                             f"input or build the model with seq_len >= {S}")
        cos_SR, sin_SR = rotary_cos_sin(S, cfg.head_dim, cfg.rope_theta, idx_BS.device)
        try:
            x_BSD = self.drop(self.tok_emb(idx_BS))
        except IndexError:      # CPU embedding lookups check their ids
            raise ValueError(f"token ids range over [{int(idx_BS.min())}, {int(idx_BS.max())}] "
                             f"but the vocabulary is [0, {cfg.vocab_size}); give ids the model "
                             "was built for") from None
        for block in self.blocks:
            x_BSD = block(x_BSD, cos_SR, sin_SR)
        logits_BSV = self.lm_head(self.norm(x_BSD))
        if targets_BS is None:
            return logits_BSV, None
        if targets_BS.shape != idx_BS.shape:
            raise ValueError(f"targets shape {tuple(targets_BS.shape)} must equal idx shape "
                             f"{tuple(idx_BS.shape)}")
        ce = F.cross_entropy(logits_BSV.float().reshape(-1, cfg.vocab_size),
                             targets_BS.reshape(-1), ignore_index=-100)
        aux = collect_aux_loss(self)
        self.last_loss_parts = {"ce": ce.detach(), "aux": aux.detach()}
        return logits_BSV, ce + aux

    def new_cache(self) -> KVCache:
        """An empty KV cache for `forward_cached` (capacity: the model's seq_len)."""
        return KVCache(self.config.n_layers, self.config.seq_len)

    def forward_cached(self, idx_BS: torch.Tensor, cache: KVCache, last_only: bool = False
                       ) -> torch.Tensor:
        """Logits of the positions after the `cache.length` cached ones ([B, S, V]; [B, 1, V]
        with last_only), caching their keys and values: an empty cache and the whole sequence
        give `forward`'s logits; then one token at a time continues it."""
        cfg = self.config
        S, past = idx_BS.shape[1], cache.length
        if S < 1 or past + S > cfg.seq_len:
            raise ValueError(f"{S} new positions after {past} cached ones: need 1 to "
                             f"{cfg.seq_len - past} (seq_len={cfg.seq_len})")
        cos_SR, sin_SR = rotary_cos_sin(past + S, cfg.head_dim, cfg.rope_theta, idx_BS.device)
        cos_SR, sin_SR = cos_SR[past:], sin_SR[past:]
        x_BSD = self.drop(self.tok_emb(idx_BS))
        for i, block in enumerate(self.blocks):
            x_BSD = block(x_BSD, cos_SR, sin_SR, cache, i)
        cache.advance(S)
        if last_only:
            x_BSD = x_BSD[:, -1:]
        return self.lm_head(self.norm(x_BSD))

    def cache_exact(self) -> bool:
        """Whether a KV-cached forward gives a full forward's tokens: no layer drops tokens by
        capacity (which makes a token's experts depend on the other tokens of its forward)."""
        return all(m.config.capacity_factor is None for m in self.modules() if isinstance(m, MoE))

    def num_parameters(self) -> ParamCount:
        """Total, active-per-token and expert parameter counts (tied weights count once)."""
        total = sum(p.numel() for p in self.parameters())
        expert = inactive = 0
        for module in self.modules():
            if isinstance(module, MoE):
                n = sum(p.numel() for p in module.experts.parameters())
                expert += n
                inactive += n * (module.num_experts - module.config.top_k) // module.num_experts
        return ParamCount(total=total, active=total - inactive, expert=expert)

    @torch.no_grad()
    def generate(self, idx_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 kv_cache: bool = True, on_token=None) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens (temperature 0: greedy); eval mode inside.

        KV-cached (kv_cache.py): the prompt's newest seq_len tokens are prefilled in one
        forward, then each token is one forward of one position; a full cache keeps its newest
        seq_len // 2 tokens and prefills them again (the context shift). `kv_cache=False`, or a
        layer with a capacity factor, recomputes the newest seq_len tokens for every token.
        `on_token(phase, positions, tokens)`, if given, is called after each forward: "prefill"
        or "decode", the positions it fed and the tokens it generated, summed over the batch
        (moescale.train.gen_stats.GenerationMeter hooks there)."""
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} and temperature={temperature} "
                             "must be >= 0")
        cached = kv_cache and self.cache_exact()
        window, keep = self.config.seq_len, max(1, self.config.seq_len // 2)
        cache = self.new_cache() if cached else None
        was_training = self.training
        self.eval()
        try:
            for i in range(max_new_tokens):
                if not cached:
                    fed_BS = idx_BS[:, -window:]
                    logits_BSV, _ = self(fed_BS)
                    phase = "prefill" if i == 0 else "decode"
                elif i == 0 or cache.room() == 0:
                    cache.reset()
                    fed_BS = idx_BS[:, -(window if i == 0 else keep):]
                    logits_BSV = self.forward_cached(fed_BS, cache, last_only=True)
                    phase = "prefill"
                else:
                    fed_BS = idx_BS[:, -1:]
                    logits_BSV = self.forward_cached(fed_BS, cache)
                    phase = "decode"
                next_B1 = _pick(logits_BSV[:, -1, :].float(), temperature, top_k, generator)
                idx_BS = torch.cat([idx_BS, next_B1], dim=1)
                if on_token is not None:
                    on_token(phase, fed_BS.numel(), fed_BS.shape[0])
        finally:
            self.train(was_training)
        return idx_BS


def _pick(logits_BV: torch.Tensor, temperature: float, top_k: int | None,
          generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row: argmax (temperature 0) or a top-k sample."""
    if temperature == 0:
        return logits_BV.argmax(-1, keepdim=True)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1]))[0][:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    return torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=generator)


def count_parameters(config: GPTConfig) -> ParamCount:
    """Parameter counts of `GPT(config)` built on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(config)
    return model.num_parameters()
