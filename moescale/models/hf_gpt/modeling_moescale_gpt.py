"""moescale's GPT MoE language model as a transformers `PreTrainedModel` (remote code, standalone).

`moescale export` copies this file and configuration_moescale_gpt.py into the exported
directory; `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` then builds
`MoescaleGPTForCausalLM` and loads the exported weights, which keep moescale's own parameter
names (`tok_emb.weight`, `blocks.<i>.attn.qkv.weight`, `blocks.<i>.ffn.router.weight`,
`blocks.<i>.ffn.experts.w1_EDF` [E, D, F], ...). It imports torch and transformers only.

The forward computes what moescale's `GPT` computes in eval mode (pre-norm blocks, RMSNorm,
rotary embeddings rotating (x[r], x[r + Dh/2]), causal SDPA, grouped-query heads, an MoE FFN
in the layers `moe_every` picks and a dense FFN elsewhere) with moescale's routing rules:
gate logits and softmax in fp32, ties to the lowest expert index; `topk` (renormalised for
top_k > 1), `switch` (top-1, the probability as weight), `gshard` (top-2, renormalised),
`noisy_topk` (softmax over the k largest logits); a capacity factor keeps the first
ceil(cf * T * K / E) choices of each expert in k-major, position order, T being the tokens of
the call (as in moescale, the same sequence routed in a smaller call may drop differently).
The training-time randomness of moescale's routers (switch jitter, noisy_topk noise, gshard's
random second expert) and the router losses are not applied here: the loss is the shifted
token cross-entropy transformers' causal LMs return.

Generation: a transformers `DynamicCache` holds keys and values (rotary applied), positions
come from `position_ids`, else from the attention mask (left padding), else from the cache
length. Positions past `seq_len` (max_position_embeddings) are outside what the model was
trained on (moescale's own `generate` slides a seq_len window instead); with a capacity factor
each cached step routes its own few tokens, so sampled text may differ from a full recompute.

Legend: B batch, S new positions, K key positions, D model width, H heads, G key/value heads,
Dh head width, R = Dh/2, T = B*S tokens, E experts, F expert hidden width, V vocabulary.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moescale_gpt import MoescaleGPTConfig

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
               "silu": F.silu, "relu": F.relu}
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


def rotary_cos_sin(pos_BS: torch.Tensor, head_dim: int, theta: float):
    """cos_BSR, sin_BSR in fp32 for the positions pos_BS (moescale's rotary_cos_sin)."""
    inv_freq_R = theta ** (-torch.arange(0, head_dim, 2, device=pos_BS.device,
                                         dtype=torch.float32) / head_dim)
    angle_BSR = pos_BS.to(torch.float32)[..., None] * inv_freq_R
    return angle_BSR.cos(), angle_BSR.sin()


def apply_rotary(x_BHSK: torch.Tensor, cos_B1SR: torch.Tensor, sin_B1SR: torch.Tensor):
    half = x_BHSK.shape[-1] // 2
    x1, x2 = x_BHSK[..., :half].float(), x_BHSK[..., half:].float()
    out = torch.cat([x1 * cos_B1SR - x2 * sin_B1SR, x2 * cos_B1SR + x1 * sin_B1SR], dim=-1)
    return out.to(x_BHSK.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoescaleGPTConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = layer, cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
                             bias=cfg.bias or cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x_BSD, cos_B1SR, sin_B1SR, mask_B1SK, cache):
        B, S, D = x_BSD.shape
        H, G, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x_BSD).split([H * Dh, G * Dh, G * Dh], dim=-1)
        q_BHSK = apply_rotary(q.view(B, S, H, Dh).transpose(1, 2), cos_B1SR, sin_B1SR)
        k_BGSK = apply_rotary(k.view(B, S, G, Dh).transpose(1, 2), cos_B1SR, sin_B1SR)
        v_BGSK = v.view(B, S, G, Dh).transpose(1, 2)
        if cache is not None:
            k_BGSK, v_BGSK = cache.update(k_BGSK, v_BGSK, self.layer)
        if G != H:
            k_BGSK, v_BGSK = (t.repeat_interleave(H // G, 1) for t in (k_BGSK, v_BGSK))
        o_BHSK = F.scaled_dot_product_attention(q_BHSK, k_BGSK, v_BGSK, attn_mask=mask_B1SK,
                                                is_causal=mask_B1SK is None)
        return self.proj(o_BHSK.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    def __init__(self, cfg: MoescaleGPTConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False) if cfg.glu else None
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        h = self.act(self.w1(x))
        return self.w2(h * self.w3(x) if self.w3 is not None else h)


class Router(nn.Module):
    def __init__(self, cfg: MoescaleGPTConfig) -> None:
        super().__init__()
        self.kind, self.top_k = cfg.router, cfg.num_experts_per_tok
        self.renormalize = cfg.renormalize_scores()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
        self.noise_weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.d_model)) \
            if cfg.router == "noisy_topk" else None

    def forward(self, x_TD):
        """(scores_TK fp32, ids_TK): moescale's eval-mode routing, ties to the lowest index."""
        logits_TE = x_TD.float() @ self.weight.float().t()
        values_TE = logits_TE if self.kind == "noisy_topk" else torch.softmax(logits_TE, -1)
        k = 2 if self.kind == "gshard" else self.top_k
        masked_TE, picks = values_TE.clone(), []
        for _ in range(k):
            picks.append(masked_TE.argmax(dim=-1, keepdim=True))
            masked_TE.scatter_(1, picks[-1], float("-inf"))
        ids_TK = torch.cat(picks, dim=1)
        scores_TK = values_TE.gather(1, ids_TK)
        if self.kind == "noisy_topk":
            scores_TK = torch.softmax(scores_TK, dim=-1)
        elif self.renormalize:
            scores_TK = scores_TK / scores_TK.sum(-1, keepdim=True)
        return scores_TK, ids_TK


class Experts(nn.Module):
    """E stacked FFN experts: act(x W1 + b1) W2 + b2, or (act(x W1) * x W3) W2 (GLU)."""

    def __init__(self, cfg: MoescaleGPTConfig) -> None:
        super().__init__()
        E, D, Fh = cfg.num_experts, cfg.d_model, cfg.d_ff
        self.act = ACTIVATIONS[cfg.activation]
        self.w1_EDF = nn.Parameter(torch.empty(E, D, Fh))
        self.w2_EFD = nn.Parameter(torch.empty(E, Fh, D))
        self.w3_EDF = nn.Parameter(torch.empty(E, D, Fh)) if cfg.glu else None
        self.b1_EF = nn.Parameter(torch.zeros(E, Fh)) if cfg.bias else None
        self.b2_ED = nn.Parameter(torch.zeros(E, D)) if cfg.bias else None

    def expert(self, e: int, x_RD):
        h_RF = x_RD @ self.w1_EDF[e]
        if self.b1_EF is not None:
            h_RF = h_RF + self.b1_EF[e]
        h_RF = self.act(h_RF)
        if self.w3_EDF is not None:
            h_RF = h_RF * (x_RD @ self.w3_EDF[e])
        y_RD = h_RF @ self.w2_EFD[e]
        return y_RD + self.b2_ED[e] if self.b2_ED is not None else y_RD


class MoE(nn.Module):
    def __init__(self, cfg: MoescaleGPTConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.capacity_factor = cfg.capacity_factor
        self.router, self.experts = Router(cfg), Experts(cfg)

    def keep(self, ids_TK):
        """bool_TK: the choices within capacity (k-major, then position priority)."""
        keep_TK = ids_TK >= 0
        if self.capacity_factor is None:
            return keep_TK
        T, K = ids_TK.shape
        capacity = int(math.ceil(self.capacity_factor * T * K / self.num_experts
                                 * (1 - 1e-12)))
        ids_F = ids_TK.t().reshape(-1)
        onehot_FE = F.one_hot(ids_F, self.num_experts)
        rank_F = (onehot_FE.cumsum(0) * onehot_FE).sum(-1) - 1
        return keep_TK & (rank_F < capacity).view(K, T).t()

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        scores_TK, ids_TK = self.router(x_TD)
        keep_TK = self.keep(ids_TK)
        y_TD = torch.zeros_like(x_TD)
        for e in range(self.num_experts):
            t_R, k_R = torch.nonzero((ids_TK == e) & keep_TK, as_tuple=True)
            if t_R.numel():
                out_RD = self.experts.expert(e, x_TD[t_R])
                w_R1 = scores_TK[t_R, k_R][:, None]
                y_TD.index_add_(0, t_R, (out_RD.float() * w_R1).to(y_TD.dtype))
        return y_TD.view_as(x_BSD)


class Block(nn.Module):
    def __init__(self, cfg: MoescaleGPTConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.is_moe_layer(layer) else DenseFFN(cfg)

    def forward(self, x_BSD, cos_B1SR, sin_B1SR, mask_B1SK, cache):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_B1SR, sin_B1SR, mask_B1SK, cache)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class MoescaleGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """moescale's GPT (see the module docstring)."""

    config_class = MoescaleGPTConfig
    base_model_prefix = "moescale_gpt"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "tok_emb.weight"}

    def __init__(self, config: MoescaleGPTConfig) -> None:
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_emb

    def set_input_embeddings(self, value):
        self.tok_emb = value

    def get_output_embeddings(self):
        return self.lm_head

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, Router):
            module.weight.normal_(0.0, self.config.d_model ** -0.5)
            if module.noise_weight is not None:
                module.noise_weight.zero_()
        elif isinstance(module, Experts):
            for name, p in module.named_parameters(recurse=False):
                p.zero_() if name.startswith("b") else p.normal_(0.0, std)

    def _positions_and_mask(self, attention_mask, position_ids, B, S, past, device):
        """(pos_BS, mask_B1SK or None: plain causal attention over the new positions)."""
        K = past + S
        if attention_mask is not None and attention_mask.dim() == 2 and bool(attention_mask.all()):
            attention_mask = None
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -S:]
            else:
                position_ids = torch.arange(past, K, device=device).expand(B, S)
        if attention_mask is None and past == 0:
            return position_ids, None
        q_S1 = torch.arange(past, K, device=device)[:, None]
        mask_B1SK = (torch.arange(K, device=device)[None, :] <= q_S1).expand(B, 1, S, K)
        if attention_mask is not None:
            mask_B1SK = mask_B1SK & attention_mask[:, None, None, -K:].bool()
        # a left-padding query row sees no key: let it see all (its output is never used)
        return position_ids, mask_B1SK | ~mask_B1SK.any(-1, keepdim=True)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, past_key_values=None,
                logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        x_BSD = self.tok_emb(input_ids) if inputs_embeds is None else inputs_embeds
        B, S, _ = x_BSD.shape
        past = cache.get_seq_length() if cache is not None else 0
        pos_BS, mask_B1SK = self._positions_and_mask(attention_mask, position_ids, B, S, past,
                                                     x_BSD.device)
        cos_BSR, sin_BSR = rotary_cos_sin(pos_BS, self.config.head_dim, self.config.rope_theta)
        cos_B1SR, sin_B1SR = cos_BSR[:, None], sin_BSR[:, None]
        for block in self.blocks:
            x_BSD = block(x_BSD, cos_B1SR, sin_B1SR, mask_B1SK, cache if use_cache else None)
        x_BSD = self.norm(x_BSD)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            x_BSD = x_BSD[:, -logits_to_keep:]
        logits_BSV = self.lm_head(x_BSD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits_BSV[:, :-1].float().reshape(-1, logits_BSV.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits_BSV.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits_BSV,
                                      **{CACHE_FIELD: cache if use_cache else None})
