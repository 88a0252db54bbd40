"""Models: the MoE GPT language model and its named sizes; moefy (dense FFNs -> MoE, upcycling);
Hugging Face MoE import/export; the consolidated safetensors checkpoint format.

`from_hf` / `to_hf` work on transformers models but never import transformers themselves, so
transformers stays an optional extra.
"""

from moescale.models.checkpoint import (consolidated_state_dict, load_checkpoint,
                                        merge_expert_shards, read_checkpoint, save_checkpoint,
                                        slice_experts)
from moescale.models.gpt import GPT, GPTConfig, ParamCount, count_parameters
from moescale.models.hf import HFMoEBlock, from_hf, to_hf
from moescale.models.moefy import MoefyConfig, find_ffn_blocks, moefy
from moescale.models.sizes import SIZE_NAMES, gpt_config

__all__ = [
    "GPT", "GPTConfig", "HFMoEBlock", "MoefyConfig", "ParamCount", "SIZE_NAMES",
    "consolidated_state_dict", "count_parameters", "find_ffn_blocks", "from_hf", "gpt_config",
    "load_checkpoint", "merge_expert_shards", "moefy", "read_checkpoint", "save_checkpoint",
    "slice_experts", "to_hf",
]
