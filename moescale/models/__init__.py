"""Models: the MoE GPT language model and its named sizes; moefy (dense FFNs -> MoE, upcycling);
Hugging Face MoE import/export; Mixtral checkpoint directories (export_mixtral: a GPT or a moefied
Llama, import_mixtral); save_moefied / load_moefied for moefied models without an HF MoE class;
the consolidated safetensors checkpoint format.

`from_hf` / `to_hf` work on transformers models but never import transformers themselves, so
transformers stays an optional extra.
"""

from moescale.models.checkpoint import (consolidated_state_dict, load_checkpoint,
                                        merge_expert_shards, read_checkpoint, save_checkpoint,
                                        slice_experts)
from moescale.models.gpt import GPT, GPTConfig, ParamCount, count_parameters
from moescale.models.hf import HFMoEBlock, from_hf, to_hf
from moescale.models.mixtral import export_mixtral, import_mixtral
from moescale.models.moefied import load_moefied, save_moefied
from moescale.models.moefy import MoefyConfig, find_ffn_blocks, moefy
from moescale.models.resident import OffloadedExpertsWarning, resident_model
from moescale.models.sizes import SIZE_NAMES, gpt_config

__all__ = [
    "GPT", "GPTConfig", "HFMoEBlock", "MoefyConfig", "OffloadedExpertsWarning", "ParamCount",
    "SIZE_NAMES",
    "consolidated_state_dict", "count_parameters", "export_mixtral", "find_ffn_blocks", "from_hf",
    "gpt_config", "import_mixtral", "load_checkpoint", "load_moefied", "merge_expert_shards",
    "moefy", "read_checkpoint", "resident_model", "save_checkpoint", "save_moefied",
    "slice_experts", "to_hf",
]
