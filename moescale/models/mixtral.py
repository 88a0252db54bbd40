"""Mixtral-format checkpoint directories: export moescale models to them, import them back.

`export_mixtral(model, out_dir)` writes `config.json` (model_type "mixtral") and
`model.safetensors` in the layout of the published Mixtral checkpoints
(`model.layers.<i>.block_sparse_moe.gate.weight`, `...experts.<e>.w1/w2/w3.weight`, what
transformers' `save_pretrained` writes too), so `MixtralForCausalLM.from_pretrained(out_dir)`
computes the exported model's logits. It takes

- a moescale `GPT` of a Mixtral shape: GLU experts (`glu=True`; activation silu is SwiGLU,
  gelu / gelu_tanh / relu map to HF's `hidden_act` too), an MoE FFN in every layer
  (`moe_every=1`), the `topk` router with top_k >= 2 (softmax -> top-k -> renormalised, which
  is Mixtral's rule; with top_k = 1 moescale weighs the expert by its probability, Mixtral by 1),
  dropless routing (`capacity_factor=None`), no bias. Anything else raises ValueError naming the
  field and the fix. Our rotary embedding rotates the pairs (x[r], x[r + Dh/2]) by
  theta^(-2r/Dh) per position: HF's `rotate_half` convention, so q and k copy unchanged;
  `rope_theta`, `norm_eps` (rms_norm_eps) and `tie_embeddings` (tie_word_embeddings) are
  carried; `seq_len` becomes max_position_embeddings; `n_kv_heads` is num_key_value_heads
  (grouped-query attention); the fused qkv projection is split into q/k/v rows.
- a Llama or Mistral transformers model converted by `moescale.moefy` with every MLP an MoE of
  GLU experts (the same router conditions): the attention, norms and embeddings keep their names,
  the config carries over (rope_parameters, GQA heads, head_dim, sliding_window, token ids).

Experts are read through `consolidated_state_dict`, so offloaded models export too (every
expert passes through memory once, as one stacked tensor per layer). `router_aux_loss_coef`
carries `aux_loss_coef` as `moescale.models.from_hf` reads it back.

`import_mixtral(path)` reads such a directory (this layout, or transformers 5's stacked
`mlp.experts.gate_up_proj` / `down_proj` names, one file or an index of shards) into a moescale
GPT when the Mixtral config has a GPT equivalent (head_dim = hidden_size / heads, default
rope, no sliding window, no router jitter; grouped-query heads carry over).
`open_mixtral(path)` gives the config and the tensors read on demand (`LazyTensors`);
`mixtral_state` maps them to GPT names (optionally without the experts) and `mixtral_expert`
reads one expert, which is how `moescale train --model.hf` fills disk-tier experts one at a time.

transformers is not imported here: the files are written and read directly.

Legend: E experts, D model width, F expert hidden width.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from moescale.atomic import new_directory
from moescale.dispatch.protocol import FFN_SHAPE, SHARD, capabilities_of
from moescale.layers.moe import MoE
from moescale.models.checkpoint import consolidated_state_dict
from moescale.models.gpt import GPT, GPTConfig

HF_ACTIVATION = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
                 "relu": "relu"}
OUR_ACTIVATION = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
LLAMA_FAMILY = ("llama", "mistral")
WEIGHTS = "model.safetensors"
_MOE_KEY = re.compile(r"(model\.layers\.\d+)\.mlp\.moe\.(.+)")


def _refuse(field: str, value, why: str, fix: str) -> None:
    raise ValueError(f"{field}={value!r} has no Mixtral equivalent ({why}); {fix}")


def check_gpt(cfg: GPTConfig) -> None:
    """ValueError naming the first GPTConfig flat key that Mixtral cannot express, and the fix."""
    moe, rc = cfg.moe, cfg.moe.router
    if not moe.glu:
        _refuse("glu", moe.glu, "Mixtral's experts are gated: down(act(gate x) * up x)",
                "train with --model.glu true --model.activation silu (SwiGLU)")
    if moe.activation not in HF_ACTIVATION:
        _refuse("activation", moe.activation, "no transformers hidden_act computes it",
                f"use one of {', '.join(HF_ACTIVATION)} (silu: SwiGLU)")
    if cfg.moe_every != 1:
        _refuse("moe_every", cfg.moe_every, "every Mixtral layer is sparse",
                "train with --model.moe_every 1")
    if rc.kind != "topk":
        _refuse("router", rc.kind, "Mixtral routes by softmax -> top-k -> renormalise",
                "train with --model.router topk")
    if rc.top_k < 2:
        _refuse("top_k", rc.top_k, "with one expert moescale's topk router weighs it by its "
                "probability, Mixtral's renormalisation by 1", "use --model.top_k 2 or more")
    if not rc.renormalize_scores:
        _refuse("renormalize", rc.renormalize, "Mixtral renormalises the top-k", "leave it None")
    if moe.capacity_factor is not None:
        _refuse("capacity_factor", moe.capacity_factor, "Mixtral drops no token",
                "leave model.capacity_factor unset (dropless)")
    if cfg.bias or cfg.qkv_bias:
        _refuse("bias" if cfg.bias else "qkv_bias", True, "Mixtral's projections have no bias",
                "use bias=False (or export as remote code: --format moescale)")


def _check_moe(moe: MoE, where: str) -> str:
    """The HF hidden_act of a moefied layer's MoE, or ValueError naming what does not map."""
    cfg, rc = moe.config, moe.router.config
    experts = moe.experts.local if SHARD in capabilities_of(moe.experts) else moe.experts
    glu = experts.glu if FFN_SHAPE in capabilities_of(experts) else None
    if glu is not True:
        raise ValueError(f"{where}: experts {type(experts).__name__} (glu="
                         f"{glu}) have no Mixtral equivalent; Mixtral "
                         "needs stacked GLU experts without bias (moefy a gated MLP with "
                         "mlp_bias=False)")
    if cfg.bias:
        _refuse(f"{where}.bias", cfg.bias, "Mixtral's experts have no bias", "use bias=False")
    if rc.kind != "topk" or not rc.renormalize_scores:
        _refuse(f"{where}.router", f"{rc.kind} (renormalize={rc.renormalize_scores})",
                "Mixtral routes by softmax -> top-k -> renormalise",
                "moefy with router='topk' and top_k >= 2 (or renormalize=True)")
    if cfg.capacity_factor is not None:
        _refuse(f"{where}.capacity_factor", cfg.capacity_factor, "Mixtral drops no token",
                "moefy with capacity_factor=None")
    if cfg.activation not in HF_ACTIVATION:
        _refuse(f"{where}.activation", cfg.activation, "no transformers hidden_act computes it",
                f"use one of {', '.join(HF_ACTIVATION)}")
    return HF_ACTIVATION[cfg.activation]


def _experts(prefix: str, router_ED, w1_EDF, w3_EDF, w2_EFD) -> dict[str, torch.Tensor]:
    """One layer's router and experts under the published Mixtral names."""
    out = {f"{prefix}.block_sparse_moe.gate.weight": router_ED}
    for e in range(w1_EDF.shape[0]):
        ex = f"{prefix}.block_sparse_moe.experts.{e}"
        out[f"{ex}.w1.weight"] = w1_EDF[e].t()
        out[f"{ex}.w3.weight"] = w3_EDF[e].t()
        out[f"{ex}.w2.weight"] = w2_EFD[e].t()
    return out


def _stacked(state: dict, key: str, num_experts: int) -> torch.Tensor:
    t = state[key]
    if t.shape[0] != num_experts:
        raise ValueError(f"{key} holds {t.shape[0]} of {num_experts} experts (an expert-parallel "
                         "shard); export a whole model: moescale.load_run(RUN_DIR) builds one")
    return t


def gpt_to_mixtral(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors under Mixtral names) of a moescale GPT; see check_gpt."""
    cfg = model.config
    check_gpt(cfg)
    state = consolidated_state_dict(model)
    D, E, KV = cfg.d_model, cfg.moe.num_experts, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": state["tok_emb.weight"],
           "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, layer = f"blocks.{i}", f"model.layers.{i}"
        qkv = state[f"{b}.attn.qkv.weight"]
        out.update({f"{layer}.self_attn.q_proj.weight": qkv[:D],
                    f"{layer}.self_attn.k_proj.weight": qkv[D:D + KV],
                    f"{layer}.self_attn.v_proj.weight": qkv[D + KV:],
                    f"{layer}.self_attn.o_proj.weight": state[f"{b}.attn.proj.weight"],
                    f"{layer}.input_layernorm.weight": state[f"{b}.attn_norm.weight"],
                    f"{layer}.post_attention_layernorm.weight": state[f"{b}.ffn_norm.weight"]})
        ex = f"{b}.ffn.experts"
        out.update(_experts(layer, state[f"{b}.ffn.router.weight"],
                            _stacked(state, f"{ex}.w1_EDF", E), _stacked(state, f"{ex}.w3_EDF", E),
                            _stacked(state, f"{ex}.w2_EFD", E)))
    config = dict(
        vocab_size=cfg.vocab_size, hidden_size=D, intermediate_size=cfg.moe.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        hidden_act=HF_ACTIVATION[cfg.moe.activation], max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings, sliding_window=None, attention_dropout=0.0,
        num_local_experts=E, num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef, router_jitter_noise=0.0,
        initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return config, out


def moefied_to_mixtral(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of a moefied Llama/Mistral transformers model."""
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"model_type={model_type!r}: export_mixtral takes a moescale GPT or a "
                         f"moefied {' / '.join(LLAMA_FAMILY)} transformers model (their attention, "
                         "norms and rotary are Mixtral's); save other moefied models with "
                         "moescale.models.save_moefied")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            _refuse(f"config.{flag}", True, "Mixtral's projections have no bias",
                    f"build the model with {flag}=False")
    n_layers = hf_config.num_hidden_layers
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    shapes, act = set(), None
    for i in range(n_layers):
        moe = moes.get(f"model.layers.{i}.mlp.moe")
        if moe is None:
            raise ValueError(f"model.layers.{i}.mlp is not an MoE (every Mixtral layer is "
                             "sparse); moefy with every=1 and no layers= selection")
        act = _check_moe(moe, f"model.layers.{i}.mlp.moe")
        shapes.add((moe.num_experts, moe.config.top_k, moe.config.d_ff, act))
    if len(shapes) != 1:
        raise ValueError(f"the MoE layers differ in (experts, top_k, d_ff, activation): "
                         f"{sorted(shapes)}; Mixtral has one shape for every layer")
    E, K, F, act = shapes.pop()
    state = consolidated_state_dict(model)
    out: dict[str, torch.Tensor] = {}
    moe_parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        found = _MOE_KEY.fullmatch(key)
        if found:
            moe_parts.setdefault(found.group(1), {})[found.group(2)] = t
        elif not (key == "lm_head.weight" and hf_config.tie_word_embeddings):
            out[key] = t
    for layer, parts in moe_parts.items():
        extra = sorted(set(parts) - {"router.weight", "experts.w1_EDF", "experts.w3_EDF",
                                     "experts.w2_EFD"})
        if extra:
            raise ValueError(f"{layer}.mlp.moe holds {extra}, which Mixtral has no place for")
        out.update(_experts(layer, parts["router.weight"], _stacked(parts, "experts.w1_EDF", E),
                            _stacked(parts, "experts.w3_EDF", E),
                            _stacked(parts, "experts.w2_EFD", E)))
    src = hf_config.to_dict()
    config = {k: src[k] for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "rope_theta", "tie_word_embeddings", "sliding_window",
        "attention_dropout", "initializer_range", "bos_token_id", "eos_token_id",
        "pad_token_id") if k in src}
    config.update(intermediate_size=F, hidden_act=act, num_local_experts=E,
                  num_experts_per_tok=K, router_jitter_noise=0.0,
                  router_aux_loss_coef=next(iter(moes.values())).config.aux_loss_coef)
    return config, out


def write_model_files(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors into an existing (staging) directory."""
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def mixtral_config(config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """The config.json dict of a Mixtral directory (architecture, dtype and flags added)."""
    dtype = next(iter(tensors.values())).dtype
    return dict(config, architectures=["MixtralForCausalLM"], model_type="mixtral",
                dtype=str(dtype).removeprefix("torch."), output_router_logits=False,
                use_cache=True)


def export_mixtral(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write `model` (a moescale GPT or a moefied Llama/Mistral) as a Mixtral checkpoint
    directory that `transformers.MixtralForCausalLM.from_pretrained` loads (config.json +
    model.safetensors, published by one rename); returns its path."""
    convert = gpt_to_mixtral if isinstance(model, GPT) else moefied_to_mixtral
    config, tensors = convert(model)
    with new_directory(out_dir) as tmp:
        write_model_files(tmp, mixtral_config(config, tensors), tensors)
    return Path(out_dir)


# -- import ----------------------------------------------------------------------------
class LazyTensors(Mapping):
    """The tensors of a checkpoint's safetensors files, each read when it is looked up (a
    Mixtral's experts are never all in memory at once)."""

    def __init__(self, path: Path, files: list[str]) -> None:
        from safetensors import safe_open

        self.where: dict[str, object] = {}
        for name in files:
            if not (path / name).is_file():
                raise ValueError(f"{str(path / name)!r} is missing; the checkpoint is incomplete")
            handle = safe_open(str(path / name), framework="pt")
            self.where.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)

    def row(self, key: str, e: int) -> torch.Tensor:
        """tensor[e] of a stacked tensor, read alone."""
        return self.where[key].get_slice(key)[e:e + 1][0]

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def open_mixtral(path: str | os.PathLike, model_types=("mixtral",)) -> tuple[dict, LazyTensors]:
    """(config.json dict, its tensors read on demand) of a Mixtral checkpoint directory (or,
    with `model_types`, of those families' Llama-style layout)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(path)!r} has no config.json; give a Mixtral checkpoint "
                         "directory (save_pretrained's or export_mixtral's)")
    config = json.loads(cfg_file.read_text())
    if config.get("model_type") not in model_types:
        raise ValueError(f"{str(path)!r} holds model_type={config.get('model_type')!r}, not "
                         "'mixtral'; other HF MoE families load with transformers, then "
                         "moescale.models.from_hf")
    index = path / f"{WEIGHTS}.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
        if index.is_file() else [WEIGHTS]
    return config, LazyTensors(path, files)


def read_mixtral(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, every tensor) of a Mixtral checkpoint directory."""
    config, tensors = open_mixtral(path)
    return config, dict(tensors.items())


def gpt_config_of_mixtral(config: dict) -> GPTConfig:
    """The GPTConfig computing what the Mixtral config does, or ValueError naming the field."""
    heads, D = config["num_attention_heads"], config["hidden_size"]
    rope = config.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": config.get("rope_theta", 1e6)}
    checks = [("head_dim", config.get("head_dim") or D // heads, D // heads,
               "moescale's GPT uses head_dim = hidden_size / num_attention_heads"),
              ("rope_parameters.rope_type", rope.get("rope_type", "default"), "default",
               "moescale's GPT has plain rotary embeddings"),
              ("sliding_window", config.get("sliding_window"), None,
               "moescale's GPT attends to the whole sequence"),
              ("router_jitter_noise", config.get("router_jitter_noise", 0.0) or 0.0, 0.0,
               "moescale's topk router has no input jitter")]
    for field, value, want, why in checks:
        if value != want:
            raise ValueError(f"Mixtral config {field}={value!r} has no moescale GPT equivalent "
                             f"({why}); load it with transformers and moescale.models.from_hf")
    act = config.get("hidden_act", "silu")
    if act not in OUR_ACTIVATION:
        raise ValueError(f"Mixtral config hidden_act={act!r} is not one moescale's kernels "
                         f"compute ({', '.join(OUR_ACTIVATION)})")
    return GPTConfig.from_flat(
        vocab_size=config["vocab_size"], seq_len=config["max_position_embeddings"],
        n_layers=config["num_hidden_layers"], d_model=D, n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        d_ff=config["intermediate_size"], num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"], router="topk", glu=True,
        activation=OUR_ACTIVATION[act], moe_every=1,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.01)), bias=False,
        rope_theta=float(rope["rope_theta"]), norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        init_std=float(config.get("initializer_range", 0.02)))


def _layer_experts(tensors: Mapping, layer: str, E: int, F: int):
    """(router_ED, w1_EDF, w3_EDF, w2_EFD) of one layer, from either naming."""
    fused = f"{layer}.mlp.experts.gate_up_proj"
    if fused in tensors:
        gate_up_EGD, down_EDF = tensors[fused], tensors[f"{layer}.mlp.experts.down_proj"]
        return (tensors[f"{layer}.mlp.gate.weight"], gate_up_EGD[:, :F].transpose(1, 2),
                gate_up_EGD[:, F:].transpose(1, 2), down_EDF.transpose(1, 2))
    base = f"{layer}.block_sparse_moe"
    stack = [torch.stack([tensors[f"{base}.experts.{e}.{w}.weight"].t() for e in range(E)])
             for w in ("w1", "w3", "w2")]
    return (tensors[f"{base}.gate.weight"], *stack)


def mixtral_expert(tensors: Mapping, layer: int, e: int, F: int) -> dict[str, torch.Tensor]:
    """Expert e of layer `layer` under moescale's names (w1_EDF: [D, F], w3_EDF, w2_EFD: [F, D],
    the expert dim left out), reading only that expert when `tensors` is a LazyTensors."""
    fused = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    if fused in tensors:
        def row(key):
            return tensors.row(key, e) if isinstance(tensors, LazyTensors) else tensors[key][e]
        gate_up_GD = row(fused)
        return {"w1_EDF": gate_up_GD[:F].t(), "w3_EDF": gate_up_GD[F:].t(),
                "w2_EFD": row(f"model.layers.{layer}.mlp.experts.down_proj").t()}
    ex = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
    return {"w1_EDF": tensors[f"{ex}.w1.weight"].t(), "w3_EDF": tensors[f"{ex}.w3.weight"].t(),
            "w2_EFD": tensors[f"{ex}.w2.weight"].t()}


def attention_state(tensors: Mapping, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The GPT's embedding, norms and attention (moescale names) from a Llama-family layout
    (Mixtral, Llama, Mistral, Qwen2: q/k/v biases go to the fused qkv bias); KeyError naming
    a missing tensor."""
    state = {"tok_emb.weight": tensors["model.embed_tokens.weight"],
             "norm.weight": tensors["model.norm.weight"]}
    state["lm_head.weight"] = tensors["lm_head.weight"] if "lm_head.weight" in tensors \
        else state["tok_emb.weight"]
    for i in range(cfg.n_layers):
        b, layer = f"blocks.{i}", f"model.layers.{i}"
        att = f"{layer}.self_attn"
        state[f"{b}.attn.qkv.weight"] = torch.cat(
            [tensors[f"{att}.{p}_proj.weight"] for p in "qkv"])
        if cfg.qkv_bias:
            state[f"{b}.attn.qkv.bias"] = torch.cat(
                [tensors[f"{att}.{p}_proj.bias"] for p in "qkv"])
        state[f"{b}.attn.proj.weight"] = tensors[f"{att}.o_proj.weight"]
        state[f"{b}.attn_norm.weight"] = tensors[f"{layer}.input_layernorm.weight"]
        state[f"{b}.ffn_norm.weight"] = tensors[f"{layer}.post_attention_layernorm.weight"]
    return state


def mixtral_state(tensors: Mapping, cfg: GPTConfig, where: str, experts: bool = True
                  ) -> dict[str, torch.Tensor]:
    """The GPT state dict (moescale names) of a Mixtral checkpoint's tensors; without the
    stacked experts when `experts` is False (they are then read one by one: mixtral_expert)."""
    D, E, F = cfg.d_model, cfg.moe.num_experts, cfg.moe.d_ff
    try:
        state = attention_state(tensors, cfg)
        for i in range(cfg.n_layers):
            b, layer = f"blocks.{i}", f"model.layers.{i}"
            gate = f"{layer}.mlp.gate.weight" if f"{layer}.mlp.gate.weight" in tensors \
                else f"{layer}.block_sparse_moe.gate.weight"
            state[f"{b}.ffn.router.weight"] = tensors[gate]
            if experts:
                _, w1, w3, w2 = _layer_experts(tensors, layer, E, F)
                state.update({f"{b}.ffn.experts.w1_EDF": w1, f"{b}.ffn.experts.w3_EDF": w3,
                              f"{b}.ffn.experts.w2_EFD": w2})
            else:       # every expert's tensors are there (read later, one at a time)
                for e in range(E):
                    mixtral_expert_keys_present(tensors, i, e)
    except KeyError as err:
        raise ValueError(f"{where!r} lacks tensor {err.args[0]!r}; the checkpoint does not "
                         f"match its config.json (hidden_size {D}, {E} experts)") from None
    return state


def mixtral_expert_keys_present(tensors: Mapping, layer: int, e: int) -> None:
    """KeyError naming the first tensor of expert e of `layer` that the checkpoint lacks."""
    base = f"model.layers.{layer}"
    if f"{base}.mlp.experts.gate_up_proj" in tensors:
        keys = [f"{base}.mlp.experts.down_proj"]
    else:
        keys = [f"{base}.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")]
    for key in keys:
        if key not in tensors:
            raise KeyError(key)


def import_mixtral(path: str | os.PathLike, device: str | torch.device = "cpu") -> GPT:
    """A moescale GPT (eval mode) holding the weights of a Mixtral checkpoint directory."""
    config, tensors = open_mixtral(path)
    cfg = gpt_config_of_mixtral(config)
    state = mixtral_state(tensors, cfg, str(path))
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.load_state_dict(state, strict=True)
    return model.eval()
