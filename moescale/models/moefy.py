"""`moefy(model, ...)`: turn the dense FFN blocks of a transformer into moescale MoE layers.

FastMoE's fmoefy for the models people use today. Recognised blocks (by structure, so look-alike
families such as RoBERTa, Mistral, Qwen2 or Gemma are found too):

- Hugging Face GPT-2 MLP: `c_fc` / `c_proj` Conv1D (weights stored [in, out], with bias), `act`
  (gelu_new), `dropout` after c_proj. The whole MLP becomes `MoEFeedForward(moe, dropout)`.
- Llama-family gated MLP: `gate_proj`, `up_proj`, `down_proj`, `act_fn`:
  down(act(gate(x)) * up(x)) becomes GLU experts (w1 = gate, w3 = up, w2 = down).
- BERT layer (`intermediate.dense` + act, `output.dense` + dropout + residual + LayerNorm): only
  the FFN math is replaced: `intermediate` becomes the MoE and `output.dense` an Identity, so
  BertOutput still applies dropout, the residual and its LayerNorm to the MoE's output.
  (With `chunk_size_feed_forward > 0` the MoE runs once per chunk and `last_aux_loss` holds
  the last chunk's loss only.)
- `torch.nn.TransformerEncoderLayer` (linear1 / activation / linear2): the layer becomes a
  `MoEEncoderLayer` that keeps its attention, norms and dropouts and runs the slow-path math
  with the MoE as the FFN. The dropout between activation and linear2 is not reproduced (the
  experts have none); the enclosing `nn.TransformerEncoder`'s nested-tensor fast path is
  switched off because it reads linear1/linear2 directly.

Upcycling (`upcycle=True`, sparse upcycling after Komatsuzaki et al. 2023): every expert starts
as an exact copy of the dense FFN. Because the router's k scores are renormalised to sum to 1,
the converted model computes the same function as the dense one at conversion (in eval mode);
the router and the experts then diverge through training. `upcycle_noise` adds relative
Gaussian noise to the copies to break their symmetry faster (0 keeps outputs exact).

Activations are identified by probing the dense block's activation on a grid and comparing to
the kernels' gelu / gelu_tanh / silu / relu; anything else is passed to the experts as a
callable (correct, slower backward). Gated blocks with biases (mlp_bias=True) use
`ModuleExperts` holding copies of the dense module, because the stacked GLU kernels are
bias-free.

A moefied transformers model's own `save_pretrained` raises ValueError naming
`moescale.models.save_moefied` and `export_mixtral`: transformers' `from_pretrained` of the
dense class would load it with randomly re-initialised MLPs.

Deliberately not here: Mixtral/Qwen-MoE/OLMoE (already sparse: see hf.py), decoder layers of
nn.Transformer, fused gate_up projections (Phi-3), anything that needs weights downloaded.

Legend: D model width, F hidden width, E experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moescale.config_tree import flat_names
from moescale.layers.moe import MoE, MoEConfig

FFN_KINDS = ("gpt2", "gated", "bert", "torch_encoder")


@dataclass(kw_only=True)
class MoefyConfig:
    """How dense FFNs become MoE layers (plain data, validated on construction).

    every:  convert FFN i (0-based, in module order) when i % every == every - 1 (1: all,
            2: every other one, the second of each pair); `layers`, if given, lists the FFN
            indices to convert instead.
    """

    num_experts: int = 8
    top_k: int = 2
    upcycle: bool = True
    upcycle_noise: float = 0.0
    router: str = "topk"
    renormalize: bool | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    every: int = 1
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every={self.every!r} must be an integer >= 1 (1 converts every "
                             "FFN, 2 every other one)")
        if self.layers is not None:
            self.layers = tuple(int(i) for i in self.layers)
        if not self.upcycle_noise >= 0:
            raise ValueError(f"upcycle_noise={self.upcycle_noise!r} must be >= 0")
        probe = self.moe_config(8)  # validates router, top_k, capacity and loss settings
        cfg = probe.router
        if self.upcycle and not (cfg.kind == "noisy_topk" or cfg.renormalize_scores):
            raise ValueError(
                f"upcycle=True needs router scores that sum to 1, but router={self.router!r} "
                f"with top_k={self.top_k} and renormalize={self.renormalize!r} does not "
                "renormalise them; pass renormalize=True (or upcycle=False)")

    def moe_config(self, d_model: int, d_ff: int | None = None, **kw) -> MoEConfig:
        """The MoEConfig of one converted FFN: this config's fields that are MoEConfig flat keys
        (moescale.config_tree), at the FFN's width."""
        names = flat_names(MoEConfig)
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        return MoEConfig.from_flat(**mine, d_model=d_model, d_ff=d_ff, **kw)


@dataclass
class DenseFFN:
    """The weights of one dense FFN in moescale's layout: y = act(x W1 + b1) [* x W3] W2 + b2."""

    w1_DF: torch.Tensor
    w2_FD: torch.Tensor
    w3_DF: torch.Tensor | None
    b1_F: torch.Tensor | None
    b2_D: torch.Tensor | None
    activation: object   # a kernel activation name or a callable
    module: nn.Module    # the dense module (copied for ModuleExperts)


class MoEFeedForward(nn.Module):
    """An MoE standing where a dense MLP stood, with the MLP's trailing dropout (if any)."""

    def __init__(self, moe: MoE, dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.dropout = dropout if dropout is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.moe(x))


class MoEEncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer's slow-path math with an MoE feed-forward block."""

    def __init__(self, layer: nn.TransformerEncoderLayer, moe: MoE) -> None:
        super().__init__()
        self.self_attn, self.norm1, self.norm2 = layer.self_attn, layer.norm1, layer.norm2
        self.dropout1, self.dropout2 = layer.dropout1, layer.dropout2
        self.norm_first = layer.norm_first
        self.ffn = moe

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool = False
                ) -> torch.Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self.dropout2(self.ffn(self.norm2(x)))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self.dropout2(self.ffn(x)))

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)


def identify_activation(act) -> object:
    """The kernel name whose values match `act` on a probe grid, else `act` itself."""
    probe = torch.linspace(-8.0, 8.0, 2001, dtype=torch.float32)
    with torch.no_grad():
        try:
            got = act(probe)
        except Exception:  # noqa: BLE001 - an unusual activation: use it as a callable
            return act
        for name, fn in (("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
                         ("silu", F.silu), ("relu", F.relu)):
            if torch.allclose(got, fn(probe), atol=1e-6, rtol=1e-6):
                return name
    return act


def classify(module: nn.Module) -> str | None:
    """Which recognised dense FFN `module` is (one of FFN_KINDS), or None."""
    if isinstance(module, nn.TransformerEncoderLayer):
        return "torch_encoder"
    if all(hasattr(module, n) for n in ("c_fc", "c_proj", "act")) and \
            hasattr(module.c_fc, "weight") and hasattr(module.c_proj, "weight"):
        return "gpt2"
    if all(isinstance(getattr(module, n, None), nn.Linear)
           for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(module, "act_fn"):
        return "gated"
    inter, out = getattr(module, "intermediate", None), getattr(module, "output", None)
    if isinstance(getattr(inter, "dense", None), nn.Linear) and \
            isinstance(getattr(out, "dense", None), nn.Linear) and hasattr(out, "LayerNorm") \
            and hasattr(inter, "intermediate_act_fn"):
        return "bert"
    return None


def find_ffn_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """(qualified name, kind) of every recognised dense FFN block, in module order."""
    found: list[tuple[str, str]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            kind = classify(child)
            if kind is not None:
                found.append((path, kind))
            else:
                walk(child, path)

    walk(model, "")
    return found


def extract_dense(module: nn.Module, kind: str) -> DenseFFN:
    """The dense FFN of a recognised block, in moescale's [in, out] layout (views, no copies)."""
    if kind == "gpt2":   # Conv1D stores weight [in, out]
        return DenseFFN(module.c_fc.weight, module.c_proj.weight, None, module.c_fc.bias,
                        module.c_proj.bias, identify_activation(module.act), module)
    if kind == "gated":
        return DenseFFN(module.gate_proj.weight.t(), module.down_proj.weight.t(),
                        module.up_proj.weight.t(), module.gate_proj.bias,
                        module.down_proj.bias, identify_activation(module.act_fn), module)
    if kind == "bert":
        inter, out = module.intermediate, module.output
        return DenseFFN(inter.dense.weight.t(), out.dense.weight.t(), None, inter.dense.bias,
                        out.dense.bias, identify_activation(inter.intermediate_act_fn), module)
    if kind == "torch_encoder":
        return DenseFFN(module.linear1.weight.t(), module.linear2.weight.t(), None,
                        module.linear1.bias, module.linear2.bias,
                        identify_activation(module.activation), module)
    raise ValueError(f"kind={kind!r} is not one of {', '.join(FFN_KINDS)}")


def build_moe(dense: DenseFFN, cfg: MoefyConfig) -> MoE:
    """An MoE shaped like `dense`; with cfg.upcycle every expert is a copy of it."""
    d_model, d_ff = dense.w1_DF.shape
    glu, has_bias = dense.w3_DF is not None, dense.b1_F is not None
    kw = dict(device=dense.w1_DF.device, dtype=dense.w1_DF.dtype)
    moe_cfg = cfg.moe_config(d_model, d_ff, glu=glu, bias=has_bias and not glu,
                             activation=dense.activation if isinstance(dense.activation, str)
                             else "gelu")
    if glu and has_bias:
        experts = [copy.deepcopy(dense.module) for _ in range(cfg.num_experts)]
        if not cfg.upcycle:
            for linear in (m for e in experts for m in e.modules()):
                if isinstance(linear, nn.Linear):
                    linear.reset_parameters()
        moe = MoE(config=moe_cfg, experts=experts, **kw)
    else:
        act = None if isinstance(dense.activation, str) else dense.activation
        moe = MoE(config=moe_cfg, activation=act, **kw)
        if cfg.upcycle:
            ex = moe.experts
            with torch.no_grad():
                for dst, src in ((ex.w1_EDF, dense.w1_DF), (ex.w2_EFD, dense.w2_FD),
                                 (ex.w3_EDF, dense.w3_DF), (ex.b1_EF, dense.b1_F),
                                 (ex.b2_ED, dense.b2_D)):
                    if dst is not None:
                        dst.copy_(src.detach().unsqueeze(0).expand_as(dst))
    if cfg.upcycle and cfg.upcycle_noise > 0:
        with torch.no_grad():
            for p in moe.experts.parameters():
                p.add_(torch.randn_like(p) * p.abs().mean() * cfg.upcycle_noise)
    return moe


def _install(parent: nn.Module, name: str, module: nn.Module, kind: str, moe: MoE) -> None:
    if kind in ("gpt2", "gated"):
        setattr(parent, name, MoEFeedForward(moe, getattr(module, "dropout", None)
                                             if kind == "gpt2" else None))
    elif kind == "bert":
        module.intermediate = MoEFeedForward(moe)
        module.output.dense = nn.Identity()
    else:
        setattr(parent, name, MoEEncoderLayer(module, moe))


def moefy(model: nn.Module, num_experts: int = 8, top_k: int = 2, *, upcycle: bool = True,
          upcycle_noise: float = 0.0, router: str = "topk", renormalize: bool | None = None,
          capacity_factor: float | None = None, aux_loss_coef: float = 0.01,
          z_loss_coef: float = 0.0, every: int = 1, layers: Sequence[int] | None = None
          ) -> nn.Module:
    """Replace the dense FFN blocks of `model` (in place) with MoE layers; returns `model`.

    See the module docstring for the recognised blocks and the upcycling guarantee.
    Raises ValueError when the model holds no recognised FFN block or `layers` names an
    index past the blocks found.
    """
    cfg = MoefyConfig(num_experts=num_experts, top_k=top_k, upcycle=upcycle,
                      upcycle_noise=upcycle_noise, router=router, renormalize=renormalize,
                      capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef,
                      z_loss_coef=z_loss_coef, every=every,
                      layers=tuple(layers) if layers is not None else None)
    blocks = find_ffn_blocks(model)
    if not blocks:
        raise ValueError(f"moefy found no dense FFN block in {type(model).__name__}; it knows "
                         "GPT-2 MLPs, Llama-style gated MLPs, BERT layers and "
                         "nn.TransformerEncoderLayer (already-sparse models: moescale.models.hf)")
    if cfg.layers is not None:
        bad = [i for i in cfg.layers if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"layers={list(cfg.layers)} names FFN indices {bad}, but the model "
                             f"has {len(blocks)} FFN blocks (indices 0..{len(blocks) - 1})")
        chosen = set(cfg.layers)
    else:
        chosen = {i for i in range(len(blocks)) if i % cfg.every == cfg.every - 1}
    for i, (path, kind) in enumerate(blocks):
        if i not in chosen:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, name)
        moe = build_moe(extract_dense(module, kind), cfg)
        moe.train(module.training)
        _install(parent, name, module, kind, moe)
    for module in model.modules():   # its fast path reads linear1/linear2 of layer 0
        if isinstance(module, nn.TransformerEncoder) and \
                any(isinstance(m, MoEEncoderLayer) for m in module.layers):
            module.use_nested_tensor = False
    if callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"):
        model.save_pretrained = refuse_save_pretrained     # this instance only
    return model


def refuse_save_pretrained(*args, **kwargs):
    """A moefied transformers model's save_pretrained: the dense class's from_pretrained would
    drop every MoE weight and re-initialise the MLPs at random, so it refuses, naming the
    savers that reload faithfully."""
    raise ValueError("save_pretrained of a moefied model writes MoE layers that the dense "
                     "class's from_pretrained drops (its MLPs would be re-initialised at "
                     "random); save it with moescale.models.save_moefied(model, DIR) "
                     "(load_moefied reads it back), or, for a Llama / Mistral with GLU experts, "
                     "moescale.models.export_mixtral(model, DIR) (MixtralForCausalLM loads it)")
