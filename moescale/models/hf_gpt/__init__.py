"""moescale's GPT as a transformers model: the remote code that `moescale export` copies.

`configuration_moescale_gpt.py` and `modeling_moescale_gpt.py` are self-contained (they import
torch and transformers, never moescale): `moescale export` copies both into an exported
directory whose config.json names them in `auto_map`, so

    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

loads a GPT of any shape moescale trains (GELU or GLU experts, any router, capacity, dense
layers between MoE layers, biases, grouped-query heads) on a machine without moescale.
`register()` registers the classes with transformers' Auto classes for this process, for
loading without `trust_remote_code` where moescale is installed. Nothing is imported here
until `register()` is called (transformers is slow to import).
"""

from __future__ import annotations

FILES = ("configuration_moescale_gpt.py", "modeling_moescale_gpt.py")
MODEL_TYPE = "moescale_gpt"


def register() -> None:
    """Register MoescaleGPTConfig / MoescaleGPTForCausalLM with AutoConfig and
    AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moescale.models.hf_gpt.configuration_moescale_gpt import MoescaleGPTConfig
    from moescale.models.hf_gpt.modeling_moescale_gpt import MoescaleGPTForCausalLM

    AutoConfig.register(MODEL_TYPE, MoescaleGPTConfig, exist_ok=True)
    AutoModelForCausalLM.register(MoescaleGPTConfig, MoescaleGPTForCausalLM, exist_ok=True)
