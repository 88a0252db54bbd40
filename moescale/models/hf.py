"""Import/export of Hugging Face sparse MoE blocks: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

`from_hf(model)` swaps (in place) every sparse MoE block of a transformers model for an
`HFMoEBlock` holding a `moescale.MoE` with the same weights and the same routing, so the model
trains with moescale's dispatchers (offloading, expert parallelism). `to_hf(model)` puts blocks
of the original classes back, carrying the (trained) weights, so `save_pretrained` writes a
checkpoint that `from_pretrained` loads. Both conversions are exact (transposes and copies).

What the installed transformers (5.x) provides and we reproduce, for all four families:
- router `gate` (`*TopKRouter`, weight [E, D], no bias): logits = x W^T, probs = softmax in
  fp32, top-k of the probs, then divided by their sum when `norm_topk_prob` (Mixtral has no
  flag and always renormalises; Qwen3-MoE defaults True; Qwen2-MoE and OLMoE default False).
  moescale's "topk" router is the same rule with `renormalize` set from the flag. (Our router
  also computes the logits in fp32; in bf16 HF rounds the logits first: tiny differences.)
- experts (`*Experts`, stacked): `gate_up_proj` [E, 2F, D] (rows :F gate, F: up) and
  `down_proj` [E, D, F]; y = down(act(gate x) * up x). In moescale's layout:
  w1_EDF = gate^T, w3_EDF = up^T, w2_EFD = down^T (GLU experts, no bias).
- Qwen2-MoE's shared expert: a dense gated MLP `shared_expert` added to every token, scaled by
  sigmoid(`shared_expert_gate`(x)) (Linear D -> 1). `HFMoEBlock` keeps both modules as they are.
- Mixtral's `router_jitter_noise` (multiplies the input while training) is not reproduced:
  import raises ValueError when it is non-zero.

Aux loss: HF adds its load-balancing loss only with `output_router_logits=True`, found by
hooking the router classes, which are gone after import; add `moescale.collect_aux_loss(model)`
to the loss instead (its coefficient comes from `config.router_aux_loss_coef`; HF's loss equals
top_k times moescale's canonical E * sum_e f_e P_e). Keep `output_router_logits=False`.

transformers is never imported here: blocks are recognised by structure and rebuilt from
their recorded class, so this module loads without it.

Legend: E experts, D model width, F expert hidden width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moescale.layers.experts import GroupedExperts
from moescale.layers.moe import MoE, MoEConfig
from moescale.models.moefy import identify_activation
from moescale.models.resident import dense_state_dict
from moescale.routing.config import RouterConfig


def is_hf_sparse_block(module: nn.Module) -> bool:
    """A transformers sparse MoE block: `gate` router + stacked `experts` (5.x layout)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (isinstance(getattr(gate, "weight", None), torch.Tensor) and hasattr(gate, "top_k")
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def hf_to_grouped(gate_up_EGD: torch.Tensor, down_EDF: torch.Tensor):
    """(w1_EDF, w3_EDF, w2_EFD) from HF's stacked layout (G = 2F); works on grads too."""
    d_ff = down_EDF.shape[-1]
    return (gate_up_EGD[:, :d_ff].transpose(1, 2), gate_up_EGD[:, d_ff:].transpose(1, 2),
            down_EDF.transpose(1, 2))


def grouped_to_hf(w1_EDF: torch.Tensor, w3_EDF: torch.Tensor, w2_EFD: torch.Tensor):
    """(gate_up_EGD, down_EDF) in HF's stacked layout; works on grads too."""
    return torch.cat([w1_EDF, w3_EDF], dim=2).transpose(1, 2), w2_EFD.transpose(1, 2)


class HFMoEBlock(nn.Module):
    """A moescale MoE (+ Qwen2-MoE's gated shared expert) standing in for an HF sparse block.

    `hf_class` records the block class it replaced, so `to_hf` can rebuild it.
    """

    def __init__(self, moe: MoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, hf_class: type | None = None
                 ) -> None:
        super().__init__()
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("shared_expert and shared_expert_gate come together; give both "
                             "or neither")
        self.moe = moe
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.hf_class = hf_class

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden_states)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
            out = out + gate * self.shared_expert(hidden_states)
        return out


def block_from_hf(block: nn.Module, *, aux_loss_coef: float = 0.01,
                  z_loss_coef: float = 0.0) -> HFMoEBlock:
    """An HFMoEBlock with `block`'s weights (copied) and routing rule."""
    if not is_hf_sparse_block(block):
        raise ValueError(f"{type(block).__name__} is not a transformers sparse MoE block "
                         "(expected `gate` with a weight and top_k, `experts` with "
                         "gate_up_proj and down_proj)")
    jitter = getattr(block, "jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise ValueError(f"router_jitter_noise={jitter} is not supported by moescale's top-k "
                         "router; set config.router_jitter_noise = 0 before converting")
    gate, experts = block.gate, block.experts
    num_experts, d_model = gate.weight.shape
    d_ff = experts.down_proj.shape[-1]
    activation = identify_activation(experts.act_fn)
    cfg = MoEConfig(d_model=d_model, d_ff=d_ff, glu=True, bias=False,
                    activation=activation if isinstance(activation, str) else "silu",
                    aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
                    router=RouterConfig(kind="topk", num_experts=num_experts, top_k=gate.top_k,
                                        renormalize=bool(getattr(gate, "norm_topk_prob", True))))
    kw = dict(device=gate.weight.device, dtype=experts.gate_up_proj.dtype)
    moe = MoE(config=cfg, activation=None if isinstance(activation, str) else activation, **kw)
    with torch.no_grad():
        moe.router.weight.copy_(gate.weight)
        w1, w3, w2 = hf_to_grouped(experts.gate_up_proj, experts.down_proj)
        moe.experts.w1_EDF.copy_(w1)
        moe.experts.w3_EDF.copy_(w3)
        moe.experts.w2_EFD.copy_(w2)
    moe.train(block.training)
    return HFMoEBlock(moe, getattr(block, "shared_expert", None),
                      getattr(block, "shared_expert_gate", None), hf_class=type(block))


def block_to_hf(block: HFMoEBlock, config: Any) -> nn.Module:
    """A block of the recorded HF class, built from `config`, carrying `block`'s weights."""
    if block.hf_class is None:
        raise ValueError("this HFMoEBlock has no hf_class; build it with block_from_hf or "
                         "pass hf_class=<the transformers block class>")
    experts = block.moe.experts
    if not isinstance(experts, GroupedExperts) or not experts.glu:
        raise ValueError("only GLU GroupedExperts map back to a transformers block; got "
                         f"{type(experts).__name__}")
    ref = block.moe.router.weight
    with torch.device("meta"):
        hf = block.hf_class(config)
    hf = hf.to_empty(device=ref.device).to(experts.w1_EDF.dtype)
    with torch.no_grad():
        hf.gate.weight.copy_(block.moe.router.weight)
        gate_up, down = grouped_to_hf(experts.w1_EDF, experts.w3_EDF, experts.w2_EFD)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)
    if block.shared_expert is not None:
        hf.shared_expert, hf.shared_expert_gate = block.shared_expert, block.shared_expert_gate
    if hf.gate.top_k != block.moe.config.top_k or hf.gate.weight.shape != ref.shape:
        raise ValueError(f"config builds a block with top_k={hf.gate.top_k} and router "
                         f"{tuple(hf.gate.weight.shape)}, but the moescale block has "
                         f"top_k={block.moe.config.top_k} and {tuple(ref.shape)}; pass the "
                         "config the model was imported with")
    hf.train(block.training)
    return hf


def _replace(model: nn.Module, want, convert) -> int:
    targets = [name for name, m in model.named_modules() if name and want(m)]
    for path in targets:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, convert(getattr(parent, name)))
    return len(targets)


def from_hf(model: nn.Module, *, aux_loss_coef: float | None = None,
            z_loss_coef: float = 0.0) -> nn.Module:
    """Swap every HF sparse MoE block of `model` for an HFMoEBlock (in place); returns model.

    aux_loss_coef: None takes `model.config.router_aux_loss_coef` (0.01 when absent).
    """
    if aux_loss_coef is None:
        aux_loss_coef = float(getattr(getattr(model, "config", None), "router_aux_loss_coef",
                                      0.01) or 0.0)
    count = _replace(model, is_hf_sparse_block,
                     lambda b: block_from_hf(b, aux_loss_coef=aux_loss_coef,
                                             z_loss_coef=z_loss_coef))
    if count == 0:
        raise ValueError(f"from_hf found no sparse MoE block in {type(model).__name__}; it "
                         "converts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models (for dense "
                         "models use moescale.moefy)")
    return model


def to_hf(model: nn.Module, config: Any = None) -> nn.Module:
    """Put HF sparse blocks back in place of every HFMoEBlock (in place); returns model.

    config: the transformers config the blocks are built from (default: `model.config`).
    """
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config; pass config=<the "
                         "transformers config of the model>")
    count = _replace(model, lambda m: isinstance(m, HFMoEBlock),
                     lambda b: block_to_hf(b, config))
    if count == 0:
        raise ValueError(f"to_hf found no HFMoEBlock in {type(model).__name__}; convert with "
                         "from_hf first")
    return model


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict `to_hf(model)` would have, without changing `model` (tensors copied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in dense_state_dict(model).items():
        out[name] = tensor
    for path, module in model.named_modules():
        if not isinstance(module, HFMoEBlock):
            continue
        prefix = f"{path}." if path else ""
        for key in [k for k in out if k.startswith(prefix + "moe.")]:
            del out[key]
        ex = module.moe.experts
        gate_up, down = grouped_to_hf(ex.w1_EDF.detach(), ex.w3_EDF.detach(),
                                      ex.w2_EFD.detach())
        out[prefix + "gate.weight"] = module.moe.router.weight.detach()
        out[prefix + "experts.gate_up_proj"] = gate_up.contiguous()
        out[prefix + "experts.down_proj"] = down.contiguous()
    return out
