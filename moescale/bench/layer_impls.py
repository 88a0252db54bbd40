"""The implementations that `moescale bench layer` times side by side, all on the same work.

- floor: the GEMM work an MoE layer cannot avoid, built from plain matmul autograd: the routed
  rows (tokens x k) through (i) one dense FFN, (ii) num_experts FFNs on an even split of them.
  Where torch's own low-precision GEMM is slow (bf16 on CPUs without AVX512-BF16/AMX) the floor
  multiplies the low-precision operands in fp32 and rounds, exactly as moescale's kernels do
  (`grouped_ffn.mm_into`), so that the floor is the fastest GEMM available, not a strawman.
- moescale: `moescale.MoE` (dropless, top-k softmax router).
- naive loop: the plain PyTorch MoE one writes first (and many codebases ship): moescale's
  router, then for each expert a boolean mask of its routing choices, its tokens gathered,
  its FFN in matmul autograd, the score-weighted output `index_add_`ed into y. Dropless.
- Hugging Face transformers' `MixtralSparseMoeBlock` with each experts implementation (eager,
  grouped_mm, batched_mm), with moescale's weights copied in (GLU experts only: Mixtral's).
- DeepSpeed-MoE's `deepspeed.moe.layer.MoE` (capacity factors 1.0 and 2.0; dense dispatch).

Peers are optional: a missing package yields a `Skipped` record with the reason. This file
builds closures; timing and reporting live in `measure.py` and `layer.py`.

Legend: T tokens, R routed rows (T*K), D model width, F expert hidden width, E experts.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from moescale.dispatch.plan import build_plan
from moescale.layers.grouped_ffn import mm_into, needs_fp32_gemm
from moescale.layers.moe import MoE
from moescale.routing.config import expert_capacity


@dataclass
class Candidate:
    """One implementation ready to run: `forward()` returns the scalar loss (y * g).sum()."""

    name: str
    family: str                          # "floor" | "moescale" | "peer"
    forward: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]           # inputs and parameters whose .grad is dropped per step
    params: list[torch.Tensor]           # excluded from the saved-activation count
    tokens: int
    rows: int                            # routed rows actually computed per step
    note: str = ""
    reduced: bool = False                # measured on fewer tokens than the case
    max_abs_diff: float | None = None    # output vs moescale on the same tokens (sanity)
    extra: dict = field(default_factory=dict)
    loss_weights: list[torch.Tensor] = field(default_factory=list)   # g: the loss's, not the
    # layer's (y * g saves g); excluded from the saved-activation count too

    def step(self) -> None:
        self.forward().backward()

    def reset(self) -> None:
        for t in self.leaves:
            t.grad = None


@dataclass
class Skipped:
    name: str
    reason: str


# ----------------------------------------------------------------------------- the floor

class _UpcastMatmul(torch.autograd.Function):
    """x @ w computed in fp32 from low-precision operands, rounded (moescale's mm_into)."""

    @staticmethod
    def forward(ctx, x_ND, w_DF):
        out_NF = x_ND.new_empty(x_ND.shape[0], w_DF.shape[1])
        mm_into(out_NF, x_ND, w_DF)
        ctx.save_for_backward(x_ND, w_DF)
        return out_NF

    @staticmethod
    def backward(ctx, g_NF):
        x_ND, w_DF = ctx.saved_tensors
        gx_ND = x_ND.new_empty(x_ND.shape)
        mm_into(gx_ND, g_NF, w_DF.t())
        gw_DF = w_DF.new_empty(w_DF.shape)
        mm_into(gw_DF, x_ND.t(), g_NF)
        return gx_ND, gw_DF


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if needs_fp32_gemm(x):
        return _UpcastMatmul.apply(x, w)
    return x @ w


def floor_gemm_name(x: torch.Tensor) -> str:
    if needs_fp32_gemm(x):
        return f"fp32 GEMM on {str(x.dtype).removeprefix('torch.')} operands, rounded (mm_into)"
    return "torch.matmul autograd"


def _ffn(x_ND, w1_DF, w2_FD, w3_DF, act):
    a_NF = act(_matmul(x_ND, w1_DF))
    if w3_DF is not None:
        a_NF = a_NF * _matmul(x_ND, w3_DF)
    return _matmul(a_NF, w2_FD)


def _expert_leaves(moe: MoE, e: int) -> tuple:
    """Expert e's weights as fresh leaves sharing moescale's storage (their own grads)."""
    ex = moe.experts
    def leaf(p):
        return None if p is None else p.detach()[e].requires_grad_(True)
    return leaf(ex.w1_EDF), leaf(ex.w2_EFD), leaf(ex.w3_EDF)


def build_floor(moe: MoE, num_rows: int, split: bool, dtype, device,
                generator: torch.Generator) -> Candidate:
    """(i) num_rows rows through one FFN, or (ii) an even split over num_experts FFNs."""
    d_model, act = moe.config.d_model, moe.experts.act.forward
    x_RD = torch.randn(num_rows, d_model, generator=generator).to(device, dtype)
    g_RD = torch.randn(num_rows, d_model, generator=generator).to(device, dtype)
    groups = moe.num_experts if split else 1
    bounds = [num_rows * i // groups for i in range(groups + 1)]
    xs = [x_RD[s:t].detach().requires_grad_(True) for s, t in zip(bounds, bounds[1:])]
    gs = [g_RD[s:t] for s, t in zip(bounds, bounds[1:])]
    weights = [_expert_leaves(moe, e) for e in range(groups)]

    def forward():
        loss = None
        for x, g, (w1, w2, w3) in zip(xs, gs, weights):
            part = (_ffn(x, w1, w2, w3, act) * g).sum()
            loss = part if loss is None else loss + part
        return loss

    params = [w for ws in weights for w in ws if w is not None]
    name = f"floor: {groups} FFNs, even split" if split else "floor: 1 dense FFN"
    return Candidate(name=name, family="floor", forward=forward, leaves=xs + params,
                     params=params, tokens=num_rows // moe.config.top_k, rows=num_rows,
                     loss_weights=[g_RD],
                     note=floor_gemm_name(x_RD))


# ----------------------------------------------------------------------------- moescale

def build_moescale(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor) -> Candidate:
    x_TD = x_TD.detach().requires_grad_(True)
    params = list(moe.parameters())

    def forward():
        return (moe(x_TD) * g_TD).sum()

    return Candidate(name="moescale", family="moescale", forward=forward,
                     leaves=[x_TD] + params, params=params, tokens=x_TD.shape[0],
                     rows=x_TD.shape[0] * moe.config.top_k, note="dropless",
                     loss_weights=[g_TD])


def _reference_output(moe: MoE, x_TD: torch.Tensor, capacity_factor=None) -> torch.Tensor:
    saved = moe.config
    try:
        if capacity_factor is not None:
            moe.config = replace(saved, capacity_factor=capacity_factor)
        with torch.no_grad():
            return moe(x_TD)
    finally:
        moe.config = saved


def _max_diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max()) if y.numel() else 0.0


# ----------------------------------------------------------------------------- naive loop

def build_naive_loop(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor) -> Candidate:
    """Boolean masks per expert + index_add_, on moescale's router and weights."""
    x_TD = x_TD.detach().requires_grad_(True)
    ex, act = moe.experts, moe.experts.act.forward
    params = list(moe.parameters())

    def layer(x):
        route = moe.router(x)
        y_TD = torch.zeros_like(x)
        for e in range(moe.num_experts):
            mask_TK = route.expert_ids_TK == e
            tok_N, slot_N = torch.nonzero(mask_TK, as_tuple=True)
            if tok_N.numel() == 0:
                continue
            w3 = None if ex.w3_EDF is None else ex.w3_EDF[e]
            y_ND = _ffn(x[tok_N], ex.w1_EDF[e], ex.w2_EFD[e], w3, act)
            score_N1 = route.scores_TK[tok_N, slot_N].unsqueeze(1).to(y_ND.dtype)
            y_TD.index_add_(0, tok_N, y_ND * score_N1)
        return y_TD

    def forward():
        return (layer(x_TD) * g_TD).sum()

    with torch.no_grad():
        diff = _max_diff(layer(x_TD), _reference_output(moe, x_TD))
    return Candidate(name="naive loop (masks + index_add_)", family="naive", forward=forward,
                     leaves=[x_TD] + params, params=params, tokens=x_TD.shape[0],
                     rows=x_TD.shape[0] * moe.config.top_k, note="dropless",
                     max_abs_diff=diff, loss_weights=[g_TD])


# ----------------------------------------------------------------------------- Hugging Face

HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def build_hf(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor, implementation: str,
             note: str = "") -> Candidate | Skipped:
    name = f"hf mixtral ({implementation})"
    cfg = moe.config
    if not cfg.glu or moe.experts.act.name != "silu" or cfg.bias:
        return Skipped(name, "Mixtral experts are bias-free SiLU GLUs; run with --expert glu")
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError as err:
        return Skipped(name, f"transformers is not installed ({err}); pip install transformers")
    hf_cfg = MixtralConfig(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                           num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                           hidden_act="silu", router_jitter_noise=0.0)
    try:
        hf_cfg._experts_implementation = implementation
    except (KeyError, ValueError) as err:
        return Skipped(name, f"this transformers version lacks it ({err})")
    w = moe.experts
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(hf_cfg)
    block = block.to_empty(device=x_TD.device).to(x_TD.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([w.w1_EDF, w.w3_EDF], 2).transpose(1, 2))
        block.experts.down_proj.copy_(w.w2_EFD.transpose(1, 2))
    block.train()
    x_1TD = x_TD.detach().unsqueeze(0).requires_grad_(True)
    g_1TD = g_TD.unsqueeze(0)
    params = list(block.parameters())

    def forward():
        return (block(x_1TD) * g_1TD).sum()

    with torch.no_grad():
        diff = _max_diff(block(x_1TD)[0], _reference_output(moe, x_TD))
    return Candidate(name=name, family="peer", forward=forward, leaves=[x_1TD] + params,
                     params=params, tokens=x_TD.shape[0], rows=x_TD.shape[0] * cfg.top_k,
                     note=note, max_abs_diff=diff, loss_weights=[g_1TD])


# ----------------------------------------------------------------------------- DeepSpeed

class _DSExpert(nn.Module):
    """One FFN/GLU expert as DeepSpeed-MoE wants it (an nn.Module it deep-copies E times)."""

    def __init__(self, d_model: int, d_ff: int, glu: bool, act) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if glu else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.act = act

    def forward(self, x):
        a = self.act(self.w1(x))
        if self.w3 is not None:
            a = a * self.w3(x)
        return self.w2(a)


def ensure_process_group() -> bool:
    """DeepSpeed-MoE needs torch.distributed: a 1-rank gloo group on 127.0.0.1.

    Returns True when this call created the group (the caller destroys it).
    """
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    return True


def build_deepspeed(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor, capacity_factor: float,
                    note: str = "") -> Candidate | Skipped:
    name = f"deepspeed-moe (cf {capacity_factor:g})"
    cfg = moe.config
    if cfg.bias:
        return Skipped(name, "the benchmark's DeepSpeed experts are bias-free")
    try:
        import logging
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.moe.layer import MoE as DSMoE
    except Exception as err:  # noqa: BLE001 - any import failure means: peer not available
        return Skipped(name, f"deepspeed is not importable ({type(err).__name__}: {err}); "
                       "pip install deepspeed")
    ensure_process_group()
    expert = _DSExpert(cfg.d_model, cfg.d_ff, cfg.glu, moe.experts.act.forward)
    layer = DSMoE(hidden_size=cfg.d_model, expert=expert, num_experts=cfg.num_experts,
                  ep_size=1, k=cfg.top_k, capacity_factor=capacity_factor,
                  eval_capacity_factor=capacity_factor, min_capacity=0, drop_tokens=True,
                  use_rts=False, top2_2nd_expert_sampling=False)
    layer = layer.to(x_TD.device, x_TD.dtype)
    w = moe.experts
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(moe.router.weight)
        for e, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            ex.w1.weight.copy_(w.w1_EDF[e].t())
            ex.w2.weight.copy_(w.w2_EFD[e].t())
            if ex.w3 is not None:
                ex.w3.weight.copy_(w.w3_EDF[e].t())
    layer.train()
    x_1TD = x_TD.detach().unsqueeze(0).requires_grad_(True)
    g_1TD = g_TD.unsqueeze(0)
    params = list(layer.parameters())

    def forward():
        return (layer(x_1TD)[0] * g_1TD).sum()

    # Rows it computes usefully: kept routing choices under the same capacity rule
    # (k-major position priority, capacity = ceil(cf * T * k / E)); the padding up to E x C
    # rows that its dense dispatch also multiplies is not counted in its favour.
    num_tokens = x_TD.shape[0]
    capacity = expert_capacity(capacity_factor, num_tokens, cfg.top_k, cfg.num_experts)
    with torch.no_grad():
        route = moe.router(x_TD)
        plan = build_plan(route.scores_TK, route.expert_ids_TK, cfg.num_experts, capacity)
    return Candidate(name=name, family="peer", forward=forward, leaves=[x_1TD] + params,
                     params=params, tokens=num_tokens, rows=plan.num_rows, note=note,
                     loss_weights=[g_1TD],
                     extra={"capacity": capacity, "padded_rows": capacity * cfg.num_experts,
                            "dropped_choices": plan.num_dropped})


def reduced_inputs(x_TD: torch.Tensor, g_TD: torch.Tensor, num_tokens: int):
    """The first num_tokens tokens (peers too slow or too large at the full size)."""
    return x_TD[:num_tokens].clone(), g_TD[:num_tokens].clone()

