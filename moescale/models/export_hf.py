"""Every moescale GPT as a directory transformers loads: Mixtral where it fits, else remote code.

    fmt = export_hf(model, "exported")      # "mixtral" or "moescale"; returns (path, fmt)

Formats:
- `mixtral`: models/mixtral.py's `export_mixtral` (GLU experts, topk router with top_k >= 2,
  dropless, every layer an MoE, no bias; moefied Llama/Mistral too): transformers' own
  MixtralForCausalLM, no code of ours involved.
- `moescale`: any GPT (GELU or other non-gated experts, switch / gshard / noisy_topk routers,
  a capacity factor, moe_every > 1, biases): config.json with model_type "moescale_gpt" and
  `auto_map`, model.safetensors under moescale's own parameter names, and the two remote-code
  files of models/hf_gpt copied beside them, so
  `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` builds the same network
  without moescale installed (models/hf_gpt/modeling_moescale_gpt.py says what it computes).
- `auto` (the default): mixtral when the model has a Mixtral equivalent, else moescale.

`extra_config` adds keys to config.json (token ids); `write_extra(folder)` may add files
(tokenizer, generation config) to the staging directory before it is published in one rename,
so OUT is either absent or complete. OUT must not exist or be empty.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from moescale.atomic import new_directory
from moescale.models.checkpoint import EXPERT_SUFFIXES, consolidated_state_dict
from moescale.models.gpt import GPT
from moescale.models.hf_gpt import FILES as REMOTE_FILES
from moescale.models.hf_gpt import MODEL_TYPE
from moescale.models.mixtral import (check_gpt, gpt_to_mixtral, mixtral_config,
                                     moefied_to_mixtral, write_model_files)

FORMATS = ("auto", "mixtral", "moescale")
REMOTE_DIR = Path(__file__).with_name("hf_gpt")


def pick_format(model: nn.Module, fmt: str = "auto") -> str:
    """'mixtral' or 'moescale' for `model`; ValueError when `fmt` cannot hold it."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if not isinstance(model, GPT):
        if fmt == "moescale":
            raise ValueError("format='moescale' takes a moescale GPT; a moefied transformers "
                             "model exports as 'mixtral' (Llama/Mistral) or with save_moefied")
        return "mixtral"
    if fmt != "auto":
        if fmt == "mixtral":
            check_gpt(model.config)
        return fmt
    try:
        check_gpt(model.config)
    except ValueError:
        return "moescale"
    return "mixtral"


def gpt_to_moescale_hf(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors under moescale's names) of the remote-code format."""
    cfg = model.config
    state = consolidated_state_dict(model)
    for key, t in state.items():
        if key.endswith(EXPERT_SUFFIXES) and t.shape[0] != cfg.moe.num_experts:
            raise ValueError(f"{key} holds {t.shape[0]} of {cfg.moe.num_experts} experts (an "
                             "expert-parallel shard); export a whole model: "
                             "moescale.load_run(RUN_DIR) builds one")
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    dtype = next(iter(state.values())).dtype
    fields = cfg.to_flat()      # the GPTConfig tree's flat keys (moescale.config_tree)
    fields["num_experts_per_tok"] = fields.pop("top_k")   # transformers: top_k is sampling's
    config = dict(fields, model_type=MODEL_TYPE,
                  architectures=["MoescaleGPTForCausalLM"],
                  auto_map={"AutoConfig": "configuration_moescale_gpt.MoescaleGPTConfig",
                            "AutoModelForCausalLM":
                                "modeling_moescale_gpt.MoescaleGPTForCausalLM"},
                  tie_word_embeddings=cfg.tie_embeddings, use_cache=True,
                  dtype=str(dtype).removeprefix("torch."))
    return config, state


def export_hf(model: nn.Module, out_dir: str | os.PathLike, fmt: str = "auto", *,
              extra_config: dict | None = None,
              write_extra: Callable[[Path], None] | None = None) -> tuple[Path, str]:
    """Write `model` to the new directory `out_dir` (see the module docstring); returns
    (out_dir, the format written)."""
    fmt = pick_format(model, fmt)
    if fmt == "mixtral":
        config, tensors = gpt_to_mixtral(model) if isinstance(model, GPT) \
            else moefied_to_mixtral(model)
        config = mixtral_config(config, tensors)
    else:
        config, tensors = gpt_to_moescale_hf(model)
    config.update(extra_config or {})
    with new_directory(out_dir) as tmp:
        write_model_files(tmp, config, tensors)
        if fmt == "moescale":
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE_DIR / name, tmp / name)
        if write_extra is not None:
            write_extra(tmp)
    return Path(out_dir), fmt
