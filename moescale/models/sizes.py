"""Named model sizes: `gpt_config(name, **overrides) -> GPTConfig`, in flat keys (config_tree).

- `tiny`:  the CPU default (byte-level vocabulary of 256): 4 layers, d_model 128, 4 heads,
           d_ff 512, 8 experts top-2, seq_len 128: 4.5M parameters (1.3M active per token).
           Measured on the shared 2-core dev box (load ~4, torch.set_num_threads(1); two
           threads were 4x slower under contention): ~1.7 s per AdamW step at batch 16 x 128
           tokens, so 5 minutes give ~170 steps; byte-level loss falls 5.5 -> 3.1 within the
           first 15 steps and keeps falling.
- `small`: a GPU-sized byte-level model: 8 layers, d_model 512, 8 heads, d_ff 2048, 16 experts
           top-2, seq_len 512 (277M parameters, 42M active).
- `moe-s`, `moe-m`, `moe-l`: the ES-MoE paper's (Kim et al., ICML 2024) three families, with
           any number of experts (`num_experts=...`, default 8).

How the ES-MoE families were inferred from the paper's parameter table (moe-s with 8 experts
~521M and with 64 experts ~3.70B, moe-m with 8 ~1.76B, moe-l with 8 ~3.93B):
per layer an expert holds 2 * d_model * d_ff weights and attention 4 * d_model^2. For moe-s,
12 * (8 * 4.72M + 2.36M) = 481M; the remaining ~40M is one 50257 x 768 embedding (38.6M):
a GPT-2 vocabulary with TIED input/output embeddings (untied would give 560M, +7%). The 64-expert
figure pins where the experts go: 12 * (64 * 4.72M + 2.36M) + 38.6M = 3.69B only if EVERY layer
is an MoE layer (every other layer would give 1.85B). moe-m and moe-l then follow with no free
choice: 24 * (8 * 8.39M + 4.19M) + 51.5M = 1.76B and 24 * (8 * 18.9M + 9.44M) + 77.2M = 3.93B.
Position embeddings are too small to be identified by the table (GPT-2's learned 1024 x d_model
table adds 0.8-1.6M, 0.1-0.2%); we use rotary (no parameters). Biases, norms and routers add
< 0.1%. seq_len 1024 and the head counts (12, 16, 16) follow GPT-2 and are not identifiable
from parameter counts either.
"""

from __future__ import annotations

from moescale.config_tree import flat_names
from moescale.models.gpt import GPTConfig

SIZE_NAMES = ("tiny", "small", "moe-s", "moe-m", "moe-l")

GPT2_VOCAB_SIZE = 50257


def _size_fields(name: str) -> dict:
    if name == "tiny":
        return dict(vocab_size=256, seq_len=128, n_layers=4, d_model=128, n_heads=4, d_ff=512,
                    num_experts=8, top_k=2)
    if name == "small":
        return dict(vocab_size=256, seq_len=512, n_layers=8, d_model=512, n_heads=8, d_ff=2048,
                    num_experts=16, top_k=2)
    es_moe = dict(vocab_size=GPT2_VOCAB_SIZE, seq_len=1024, num_experts=8, top_k=2,
                  moe_every=1, tie_embeddings=True)
    if name == "moe-s":
        return dict(es_moe, n_layers=12, d_model=768, n_heads=12, d_ff=3072)
    if name == "moe-m":
        return dict(es_moe, n_layers=24, d_model=1024, n_heads=16, d_ff=4096)
    if name == "moe-l":
        return dict(es_moe, n_layers=24, d_model=1536, n_heads=16, d_ff=6144)
    raise ValueError(f"model size {name!r} is unknown; use one of {', '.join(SIZE_NAMES)}")


def gpt_config(name: str, **overrides) -> GPTConfig:
    """The named size with `overrides` applied (e.g. gpt_config("moe-s", num_experts=64)):
    flat keys of the GPTConfig tree (GPTConfig.from_flat), so a size is flat keys too."""
    fields = _size_fields(name)
    unknown = sorted(set(overrides) - set(flat_names(GPTConfig)))
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown} in overrides for size {name!r}; "
                         f"valid fields: {', '.join(flat_names(GPTConfig))}")
    return GPTConfig.from_flat(**{**fields, **overrides})
