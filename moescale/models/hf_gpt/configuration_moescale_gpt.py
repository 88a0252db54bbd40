"""transformers configuration of moescale's GPT MoE language model (remote code, standalone).

The fields are moescale's `GPTConfig` flat keys (`GPTConfig.to_flat()`: vocab_size, seq_len,
n_layers, d_model, n_heads, n_kv_heads, d_ff, num_experts, router, renormalize,
capacity_factor, glu, activation, moe_every, tie_embeddings, bias, rope_theta, norm_eps,
init_std, ...), except top_k, which is `num_experts_per_tok` (transformers reads a config's
`top_k` as a sampling setting); the router's training-only keys (jitter_eps, noise_std_min,
random_routing) are kept as plain attributes;
`attribute_map` gives transformers' usual names (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, max_position_embeddings, intermediate_size) so
generation utilities and caches find them. This file imports only transformers.
"""

from transformers import PretrainedConfig


class MoescaleGPTConfig(PretrainedConfig):
    """moescale's GPTConfig as a transformers config (see the module docstring)."""

    model_type = "moescale_gpt"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                     "max_position_embeddings": "seq_len", "intermediate_size": "d_ff",
                     "num_local_experts": "num_experts", "rms_norm_eps": "norm_eps", "initializer_range": "init_std"}

    def __init__(self, vocab_size=256, seq_len=128, n_layers=4, d_model=128, n_heads=4,
                 n_kv_heads=None, d_ff=None, num_experts=8, num_experts_per_tok=2, router="topk",
                 renormalize=None, capacity_factor=None, glu=False, activation="gelu",
                 moe_every=1, tie_embeddings=True, bias=False, qkv_bias=False,
                 rope_theta=10000.0, norm_eps=1e-5, init_std=0.02, aux_loss_coef=0.01,
                 z_loss_coef=0.0, use_cache=True, **kwargs):
        self.vocab_size, self.seq_len, self.n_layers = vocab_size, seq_len, n_layers
        self.d_model, self.n_heads = d_model, n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.d_ff = 4 * d_model if d_ff is None else d_ff
        self.num_experts, self.router = num_experts, router
        self.num_experts_per_tok = num_experts_per_tok
        self.renormalize, self.capacity_factor = renormalize, capacity_factor
        self.glu, self.activation, self.moe_every = glu, activation, moe_every
        self.tie_embeddings, self.bias, self.qkv_bias = tie_embeddings, bias, qkv_bias
        self.rope_theta, self.norm_eps, self.init_std = rope_theta, norm_eps, init_std
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", tie_embeddings)
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has an MoE FFN (moescale's moe_every rule)."""
        return self.moe_every > 0 and layer % self.moe_every == self.moe_every - 1

    def renormalize_scores(self) -> bool:
        """moescale's RouterConfig.renormalize_scores for this router."""
        if self.renormalize is not None:
            return bool(self.renormalize)
        if self.router == "topk":
            return self.num_experts_per_tok > 1
        return self.router == "gshard"
