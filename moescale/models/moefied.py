"""Save and load a moefied transformers model that has no Hugging Face MoE equivalent.

A moefied GPT-2, BERT, or Llama with non-GLU or biased experts has no transformers class that
holds its MoE layers, and `save_pretrained` followed by the dense class's `from_pretrained`
silently re-initialises every converted MLP (transformers only warns about the missing
weights). `save_moefied(model, out_dir)` writes a directory that transformers refuses instead:

- `config.json`: model_type `moescale_moefied` (no transformers class claims it: `AutoModel*`
  raises "does not recognize this architecture"), the base model's class and its full config
  (`base_architecture`, `base_config`), and each converted FFN block with its MoE settings
  (`moefied`: block path, block index in `find_ffn_blocks` order, num_experts, top_k, router,
  renormalize, capacity_factor, aux and z-loss coefficients);
- `moefied.safetensors`: the whole state dict in moescale's consolidated format (no
  `model.safetensors`, so a dense class's `from_pretrained` raises "no file named
  model.safetensors" instead of loading the attention and re-initialising the MLPs).

`load_moefied(path)` rebuilds the base class from its config (transformers imported then),
converts the recorded blocks with `moefy` (each with its own settings) and loads every tensor
strictly; it returns the model in eval mode, as `from_pretrained` does.

Moefied Llama / Mistral models with GLU experts also export to a Mixtral checkpoint that
transformers loads natively: `moescale.models.export_mixtral`.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from torch import nn

from moescale.atomic import atomic_write_json, new_directory
from moescale.layers.moe import MoE
from moescale.models.checkpoint import check_format, load_checkpoint, save_checkpoint
from moescale.models.moefy import find_ffn_blocks, moefy

MODEL_TYPE = "moescale_moefied"
WEIGHTS = "moefied.safetensors"
FORMAT_VERSION = 1


RECORDED = ("num_experts", "top_k", "router", "renormalize", "capacity_factor",
            "aux_loss_coef", "z_loss_coef")     # MoEConfig flat keys a record keeps


def _settings(moe: MoE) -> dict:
    flat = moe.config.to_flat()
    return {name: flat[name] for name in RECORDED}


def _converted_block(model: nn.Module, moe_path: str) -> str:
    """The FFN block moefy converted into the MoE at `moe_path`: the MLP an MoEFeedForward
    replaced, or for BERT the layer whose `intermediate` it became (output.dense: Identity)."""
    holder = moe_path.removesuffix(".moe")
    parent = holder.rpartition(".")[0]
    if holder.endswith(".intermediate") and isinstance(
            getattr(getattr(model.get_submodule(parent), "output", None), "dense", None),
            nn.Identity):
        return parent
    return holder


def save_moefied(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write a moefied transformers model to a new directory (see the module docstring)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(model).__name__} has no transformers config; save_moefied "
                         "saves moefied transformers models (torch modules: save their "
                         "state_dict with moescale.models.save_checkpoint)")
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    if not moes:
        raise ValueError(f"{type(model).__name__} holds no moescale MoE layer; a dense model "
                         "saves with save_pretrained")
    converted = {_converted_block(model, name): moe for name, moe in moes.items()}
    names = [n for n, _ in model.named_modules()]
    if not set(converted) <= set(names):
        raise ValueError("an MoE layer sits where moefy puts none; save_moefied saves models "
                         "converted by moescale.moefy")
    dense = {p for p, _ in find_ffn_blocks(model)     # not the copies inside ModuleExperts
             if not any(p.startswith(f"{c}.") for c in converted)}
    order = sorted(set(converted) | dense, key=names.index)
    records = [dict(block=path, index=i, moe=_settings(converted[path]))
               for i, path in enumerate(order) if path in converted]
    meta = dict(model_type=MODEL_TYPE, format_version=FORMAT_VERSION,
                architectures=[f"moescale moefied {type(model).__name__}"],
                base_architecture=type(model).__name__, base_config=config.to_dict(),
                moefied=records,
                note=("a moescale moefied model: load it with moescale.models.load_moefied(DIR)"
                      "; transformers has no class for its MoE layers"))
    with new_directory(out_dir) as tmp:
        save_checkpoint(tmp / WEIGHTS, model, metadata={"moefied": records})
        atomic_write_json(tmp / "config.json", meta)
    return Path(out_dir)


def load_moefied(path: str | os.PathLike) -> nn.Module:
    """The model `save_moefied` wrote to `path`, in eval mode (needs transformers)."""
    path = Path(path)
    cfg_file = path / "config.json"
    meta = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    check_format(path, "a save_moefied directory", ("config.json model_type", MODEL_TYPE),
                 meta.get("model_type"), FORMAT_VERSION, meta.get("format_version"))
    transformers = importlib.import_module("transformers")
    cls = getattr(transformers, meta["base_architecture"], None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class "
                         f"{meta['base_architecture']!r}; install the version that saved it")
    model = cls(cls.config_class.from_dict(meta["base_config"]))
    blocks = find_ffn_blocks(model)
    for record in sorted(meta["moefied"], key=lambda r: -r["index"]):   # indices stay valid
        i = record["index"]
        if i >= len(blocks) or blocks[i][0] != record["block"]:
            raise ValueError(f"FFN block {i} of the rebuilt {cls.__name__} is not "
                             f"{record['block']!r}; the saved config does not rebuild the model")
        moefy(model, upcycle=False, layers=[i], **record["moe"])
    load_checkpoint(path / WEIGHTS, model)
    return model.eval()
