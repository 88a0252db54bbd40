"""Models: the MoE GPT language model and its named sizes; moefy (dense FFNs -> MoE, upcycling);
the consolidated safetensors checkpoint format.

`moescale.models.hf` (Hugging Face MoE import/export) needs transformers and is imported
explicitly, never from here, so transformers stays optional.
"""

from moescale.models.checkpoint import (load_checkpoint, merge_expert_shards, read_checkpoint,
                                        save_checkpoint, slice_experts)
from moescale.models.gpt import GPT, GPTConfig, ParamCount, count_parameters
from moescale.models.moefy import MoefyConfig, find_ffn_blocks, moefy
from moescale.models.sizes import SIZE_NAMES, gpt_config

__all__ = ["GPT", "GPTConfig", "MoefyConfig", "ParamCount", "SIZE_NAMES", "count_parameters",
           "find_ffn_blocks", "gpt_config", "load_checkpoint", "merge_expert_shards", "moefy",
           "read_checkpoint", "save_checkpoint", "slice_experts"]
