"""A dense Llama / Mistral / Qwen2 checkpoint directory upcycled into a moescale GPT MoE.

`moescale train --model.hf DENSE_DIR --model.num_experts 8 --model.top_k 2` reads a dense
model that transformers saved (config.json + safetensors) and trains it as an MoE: the
attention, norms and embeddings are the checkpoint's, and every MoE layer's experts start as
exact copies of that layer's gated MLP (w1 = gate_proj, w3 = up_proj, w2 = down_proj: the
sparse upcycling of Komatsuzaki et al. 2023, what `moescale.moefy` does in Python). The
router starts from the GPT's own random init; because the top-k scores are renormalised
(top_k >= 2), the upcycled model computes the dense model's function at step 0 whatever the
router says.

`gpt_config_of_dense(config, num_experts, top_k)` is the GPTConfig computing what the dense
config does (SwiGLU experts of width intermediate_size, every layer an MoE, grouped-query
heads, rope theta, norm eps, tied or untied embeddings; Qwen2's q/k/v biases as `qkv_bias`;
a sliding window at least max_position_embeddings wide, Mistral's default, is full attention);
a config the GPT cannot compute (a head_dim other than hidden_size / heads, scaled rope, a
narrower sliding window, biases elsewhere) raises ValueError naming the field.
`dense_state(tensors, cfg)` maps the checkpoint's tensors to the GPT's names (experts
optional), `dense_expert(tensors, layer)` gives one expert's copy (the disk tier fills
experts one at a time). GPT-2 (learned positions, LayerNorm, biases everywhere) has no GPT
equivalent: moefy it in Python (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moescale.models.gpt import GPTConfig
from moescale.models.mixtral import OUR_ACTIVATION, attention_state, gpt_config_of_mixtral

DENSE_FAMILIES = ("llama", "mistral", "qwen2")


def gpt_config_of_dense(config: dict, num_experts: int, top_k: int) -> GPTConfig:
    """The GPTConfig of the upcycled MoE (see the module docstring)."""
    kind = config.get("model_type")
    if kind not in DENSE_FAMILIES:
        raise ValueError(f"model_type={kind!r} is not a dense family moescale upcycles "
                         f"({', '.join(DENSE_FAMILIES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"config {flag}=True has no moescale GPT equivalent (the GPT's "
                             "projections are bias-free, but Qwen2's q/k/v); moefy the "
                             "transformers model in Python instead (docs/models.md)")
    act = config.get("hidden_act", "silu")
    if act not in OUR_ACTIVATION:
        raise ValueError(f"config hidden_act={act!r} is not one moescale's kernels compute "
                         f"({', '.join(OUR_ACTIVATION)})")
    as_mixtral = dict(config, num_local_experts=num_experts, num_experts_per_tok=top_k,
                      router_jitter_noise=0.0)
    window = config.get("sliding_window")
    if (kind == "qwen2" and not config.get("use_sliding_window", False)) or (
            window is not None and window >= config["max_position_embeddings"]):
        as_mixtral["sliding_window"] = None   # unused (Qwen2's flag), or wider than any input
    try:
        cfg = gpt_config_of_mixtral(as_mixtral)
    except ValueError as err:
        raise ValueError(str(err).replace("Mixtral config", f"{kind} config").replace(
            "load it with transformers and moescale.models.from_hf",
            "moefy the transformers model in Python (docs/models.md)")) from None
    cfg.qkv_bias = kind == "qwen2"
    return cfg


def dense_expert(tensors: Mapping, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s gated MLP as one expert (moescale names, the expert dim left out)."""
    mlp = f"model.layers.{layer}.mlp"
    return {"w1_EDF": tensors[f"{mlp}.gate_proj.weight"].t(),
            "w3_EDF": tensors[f"{mlp}.up_proj.weight"].t(),
            "w2_EFD": tensors[f"{mlp}.down_proj.weight"].t()}


def dense_state(tensors: Mapping, cfg: GPTConfig, where: str, experts: bool = True
                ) -> dict[str, torch.Tensor]:
    """The GPT state dict (moescale names, routers left out) of a dense checkpoint's tensors,
    every expert a copy of its layer's MLP (none when `experts` is False)."""
    try:
        state = attention_state(tensors, cfg)
        for i in range(cfg.n_layers):
            expert = dense_expert(tensors, i)
            if experts:
                state.update({f"blocks.{i}.ffn.experts.{name}":
                              t.unsqueeze(0).expand(cfg.moe.num_experts, *t.shape).contiguous()
                              for name, t in expert.items()})
    except KeyError as err:
        raise ValueError(f"{where!r} lacks tensor {err.args[0]!r}; the checkpoint does not "
                         f"match its config.json (hidden_size {cfg.d_model})") from None
    return state
