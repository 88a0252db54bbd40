"""The run's model: a named size with overrides, or `--model.hf DIR` (a Hugging Face directory).

`model_config(config, vocab_size)` is the one place a run's GPTConfig is resolved (the trainer,
the memory check, the exchange's expert count and `load_run` all ask it). Without `model.hf` it
is `gpt_config(model.size, vocab, train.seq_len, **overrides)`. With `model.hf = DIR` holding a
Mixtral it is the GPT computing what DIR/config.json's Mixtral computes (models/mixtral.py
`gpt_config_of_mixtral`: vocabulary, max_position_embeddings as seq_len, rope theta, norm eps,
tied or untied embeddings), with the HF_TUNABLE options (top_k, aux/z loss coefficients,
dropout; num_experts only as the checkpoint's) applied, refused when the result could not be
exported as Mixtral (top_k 1). With DIR holding a dense Llama / Mistral / Qwen2 it is the
upcycled MoE of models/upcycle_hf.py: the dense config's shape with SwiGLU experts,
model.num_experts (8 unless given) and top_k (2). Shape options given with model.hf are refused
by the config itself. Both are refused when the data's vocabulary is larger than the model's
or train.seq_len exceeds max_position_embeddings.

Mixtral and the dense Llama family map onto a moescale GPT (same attention, norms, rotary;
moescale's topk router is Mixtral's softmax -> top-k -> renormalise). Qwen2-MoE and Qwen3-MoE
have shared experts (and Qwen3 q/k norms), OLMoE q/k norms: a GPT cannot hold them, and they
are refused naming moescale.models.from_hf, which fine-tunes them in a transformers loop;
GPT-2 and BERT are refused naming moescale.moefy.

`load_hf_weights(model, config)` fills the built GPT from DIR's safetensors (a config-only
directory leaves the random init: training from scratch); an upcycled model's experts are
copies of the dense MLPs and its routers keep their random init. Dense weights are loaded at
once; experts built on the meta device (disk tier) are read one at a time through the model's
`expert_init` as offload_moe writes them to their files, so no layer's experts are all in
memory. Expert-parallel ranks load the whole model, then keep their shard (the exchange).

At the end of a finished run rank 0 writes the trained model to RUN_DIR/hf (hf_export.py:
load_run + export, so every residency and rank count exports the same way), replacing an
earlier export of the same run. The run directory keeps a copy of the source config.json
(RUN_DIR/hf_config.json), used when DIR is gone later (--resume, load_run). When DIR holds a
tokenizer and data.tokenizer is unset, the run uses DIR's tokenizer (`adopt_tokenizer`; a
directory without one is said on stderr), as it adopts nanoGPT's meta.pkl character table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from moescale.models import gpt_config
from moescale.models.gpt import GPT, GPTConfig
from moescale.models.mixtral import (check_gpt, gpt_config_of_mixtral,
                                     mixtral_expert, mixtral_state, open_mixtral)
from moescale.models.upcycle_hf import (DENSE_FAMILIES, dense_expert, dense_state,
                                        gpt_config_of_dense)
from moescale.train.config import RunConfig
from moescale.train.data import meta_tokenizer

SUPPORTED = ("mixtral",) + DENSE_FAMILIES
UPCYCLE_DEFAULTS = {"num_experts": 8, "top_k": 2}    # a dense source's MoE shape, unless given
NO_GPT = {"qwen2_moe": "shared experts", "qwen3_moe": "q/k norms",
          "olmoe": "q/k norms or top-k weights left unnormalised"}
CONFIG_COPY = "hf_config.json"
_TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def _where(config: RunConfig, run_dir) -> Path | None:
    run_dir = run_dir if run_dir is not None else (config.train.run_dir or None)
    return Path(run_dir) if run_dir is not None else None


def hf_config_json(config: RunConfig, run_dir: str | Path | None = None) -> dict:
    """model.hf's config.json (the run directory's copy when the directory is gone), checked
    to be a family --model.hf trains; ValueError naming the problem and the fix otherwise."""
    src = Path(config.model.hf)
    file = src / "config.json"
    where = _where(config, run_dir)
    if not file.is_file() and where is not None and (where / CONFIG_COPY).is_file():
        file = where / CONFIG_COPY
    elif not src.is_dir():
        raise ValueError(f"model.hf={str(src)!r} is not a directory; give a Hugging Face "
                         "checkpoint or config directory (config.json, optionally weights)")
    elif not file.is_file():
        raise ValueError(f"model.hf={str(src)!r} has no config.json; give the directory "
                         "save_pretrained wrote (or a downloaded model's snapshot)")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"model.hf: {str(file)!r} is not valid JSON ({err}); restore it")
    if not isinstance(hf, dict):
        raise ValueError(f"model.hf: {str(file)!r} holds a JSON {type(hf).__name__}, not an "
                         "object of a model's settings; give the directory save_pretrained wrote")
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        why = f" (a moescale GPT has no {NO_GPT[kind]})" if kind in NO_GPT else ""
        raise ValueError(f"model.hf={str(src)!r} holds model_type={kind!r}{why}; --model.hf "
                         f"trains {', '.join(SUPPORTED)} (dense ones upcycled to an MoE); "
                         "fine-tune qwen2_moe / qwen3_moe / olmoe with transformers and "
                         "moescale.models.from_hf, and upcycle other dense models (GPT-2, "
                         "BERT) with moescale.moefy in Python (docs/models.md)")
    return hf


def model_config(config: RunConfig, vocab_size: int, run_dir: str | Path | None = None
                 ) -> GPTConfig:
    """The run's GPTConfig (see the module docstring); `vocab_size`: the data's vocabulary."""
    mc = config.model
    if mc.hf is None:
        try:
            return gpt_config(mc.size, vocab_size=vocab_size, seq_len=config.train.seq_len,
                              **mc.overrides())
        except ValueError as err:
            raise ValueError(f"model: {err}") from None
    try:
        hf = hf_config_json(config, run_dir)
        if hf["model_type"] in DENSE_FAMILIES:     # upcycled: the MoE shape is ours to pick
            given = {**UPCYCLE_DEFAULTS, **mc.overrides()}
            cfg = gpt_config_of_dense(hf, given["num_experts"], given["top_k"])
            cfg = GPTConfig.from_flat(**{**cfg.to_flat(), **mc.overrides()})
        else:
            cfg = gpt_config_of_mixtral(hf)
            if mc.num_experts not in (None, cfg.moe.num_experts):
                raise ValueError(f"num_experts={mc.num_experts}, but the checkpoint has "
                                 f"{cfg.moe.num_experts} experts per layer; drop "
                                 "--model.num_experts")
            cfg = GPTConfig.from_flat(**{**cfg.to_flat(), **mc.overrides()})  # HF_TUNABLE only
            check_gpt(cfg)
    except ValueError as err:
        raise ValueError(f"model.hf={mc.hf!r}: {err}") from None
    except (KeyError, TypeError, ZeroDivisionError, AttributeError) as err:   # a garbled field
        raise ValueError(f"model.hf={mc.hf!r}: its config.json lacks or garbles a setting "
                         f"({type(err).__name__}: {err}); give a Mixtral config.json") from None
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"model.hf={mc.hf!r} has vocab_size {cfg.vocab_size} but the data's "
                         f"vocabulary is {vocab_size} (data.tokenizer / data.vocab_size): ids "
                         "past the model's embedding; train on data tokenized for this model "
                         "(--data.tokenizer with its tokenizer) or lower data.vocab_size")
    if config.train.seq_len > cfg.seq_len:
        raise ValueError(f"train.seq_len={config.train.seq_len} exceeds model.hf's "
                         f"max_position_embeddings {cfg.seq_len}; use train.seq_len <= "
                         f"{cfg.seq_len}")
    return cfg


def build_model(config: RunConfig, vocab_size: int, expert_device=None, run_dir=None) -> GPT:
    """The run's GPT MoE (model_config) for this vocabulary, its stacked experts on
    `expert_device` when given ("meta": experts that go straight to disk)."""
    return GPT(model_config(config, vocab_size, run_dir), expert_device=expert_device)


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The directory's safetensors weights (none: a config-only directory)."""
    return sorted(Path(hf_dir).glob("*.safetensors"))


def load_hf_weights(model: GPT, config: RunConfig) -> str:
    """Fill `model` from model.hf's weights (see the module docstring); returns one line for
    the log."""
    hf = config.model.hf
    if not weight_files(hf):
        return f"model.hf {hf}: config only, random initialisation"
    cfg = model.config
    meta = any(p.is_meta for p in model.parameters())     # disk tier: experts go to files
    try:
        hf_json, tensors = open_mixtral(hf, model_types=SUPPORTED)
        dense = hf_json["model_type"] in DENSE_FAMILIES
        state = (dense_state if dense else mixtral_state)(tensors, cfg, hf, experts=not meta)
    except (SafetensorError, OSError, json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"model.hf={hf!r}: its weights cannot be read "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                         "restore them, or remove the .safetensors files for a random "
                         "start") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if dense:       # upcycled: the routers keep their random init
        missing = [k for k in missing if not k.endswith(".ffn.router.weight")]
    if meta:
        missing = [k for k in missing if ".ffn.experts." not in k]

        def expert_init(layer: int, e: int, layout):
            values = dense_expert(tensors, layer) if dense else \
                mixtral_expert(tensors, layer, e, cfg.moe.d_ff)
            return _flat(values, layout)

        model.expert_init = expert_init      # offload_moe's initial values: the checkpoint's
    if missing or unexpected:     # pragma: no cover - mixtral_state names a missing tensor
        raise ValueError(f"model.hf={hf!r} does not fill the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    how = f"upcycled: every expert a copy of the dense MLP, {cfg.moe.num_experts} experts " \
        f"top-{cfg.moe.top_k}" if dense else "weights loaded"
    return f"model.hf {hf}: {how} ({len(weight_files(hf))} safetensors file(s))"


def _flat(values: dict, layout) -> torch.Tensor:
    return torch.cat([values[name].reshape(-1).float() for name in layout.names])


def adopt_tokenizer(config: RunConfig) -> list[str]:
    """Set data.tokenizer to model.hf's directory when it holds a tokenizer, or to nanoGPT's
    meta.pkl beside data.path's train.bin / val.bin, when data.tokenizer is unset; the run's
    config.toml records it. Returns the notes to print once the model is built (a run refused
    later prints its one error line alone)."""
    meta = meta_tokenizer(config.data)
    if meta is not None and config.model.hf is None:
        config.data.tokenizer = meta
        return [f"data.tokenizer: nanoGPT's character table ({meta})"]
    hf = config.model.hf
    if hf is None or config.data.tokenizer:
        return []
    if any(all((Path(hf) / f).is_file() for f in files) for files in _TOKENIZER_FILES):
        config.data.tokenizer = hf
        return [f"data.tokenizer: model.hf's own tokenizer ({hf})"]
    return [f"data.tokenizer: model.hf ({hf}) holds no tokenizer (tokenizer.json or vocab.json "
            "+ merges.txt) and --data.tokenizer is unset: training on UTF-8 byte ids 0-255; "
            "give --data.tokenizer for the model's own vocabulary"]


def write_config_copy(run_dir: str | Path, config: RunConfig) -> None:
    """RUN_DIR/hf_config.json: the source config.json, for when model.hf is gone."""
    from moescale.atomic import atomic_write_json

    hf = hf_config_json(config, run_dir)
    atomic_write_json(Path(run_dir) / CONFIG_COPY, hf, indent=2)
