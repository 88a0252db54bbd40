"""MoE layer edge cases and usability: uneven routing, empty batches, bad input, composition.

Proves: experts that get no token have exactly zero gradients and the layer still equals the
reference; a whole batch on one expert; a 0-token batch runs forward and backward with a finite
aux loss; bad input raises ValueError naming the argument, the value and a fix; the layer
works under bf16 autocast inside a transformer block; `collect_aux_loss` sums the layers of a
model from their last call only; the same seed gives bitwise-identical results; a used layer
can be deep-copied. Balance-loss math on its own lives in tests/routing.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import ast
import copy
import importlib
import io
import math
import pkgutil

import pytest
import torch
from torch import nn

from moescale import MoE, MoEConfig, ReferenceMoE, collect_aux_loss

D_MODEL, D_FF = 16, 32
ROUTERS = [pytest.param("topk", 2, id="topk"), pytest.param("noisy_topk", 2, id="noisy_topk"),
           pytest.param("switch", 1, id="switch"), pytest.param("gshard", 2, id="gshard")]
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def build(num_experts=4, top_k=2, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    kw.setdefault("d_ff", D_FF)
    return MoE(D_MODEL, num_experts, top_k, **kw)


def make_input(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, D_MODEL, generator=torch.Generator().manual_seed(seed))


# --- uneven routing -------------------------------------------------------------------------

@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("glu,bias", [(False, True), (True, False)])
def test_experts_without_tokens_get_zero_grads_and_match_reference(moe_helpers, glu, bias,
                                                                   capacity_factor):
    moe = build(num_experts=8, top_k=2, glu=glu, bias=bias, capacity_factor=capacity_factor)
    x = moe_helpers.force_routing(moe, make_input(24), experts=[2, 5])
    fast, _, _ = moe_helpers.check_against_reference(moe, x)
    assert moe.last_stats.routed_E.tolist() == [0, 0, 24, 0, 0, 24, 0, 0]
    idle = [0, 1, 3, 4, 6, 7]
    for name in ("w1_EDF", "w2_EFD") + (("w3_EDF",) if glu else ("b1_EF", "b2_ED")):
        grad = fast.grads[f"experts.{name}"]
        assert grad is not None, name
        assert torch.all(grad[idle] == 0), f"{name}: an expert without tokens got a gradient"
        assert grad[[2, 5]].abs().sum() > 0, f"{name}: a used expert got no gradient"


@pytest.mark.parametrize("router,top_k", [("topk", 1), ("switch", 1)])
@pytest.mark.parametrize("capacity_factor", [None, 2.0, 0.5])
def test_whole_batch_on_one_expert_matches_reference(moe_helpers, router, top_k, capacity_factor):
    moe = build(num_experts=4, top_k=top_k, router=router, capacity_factor=capacity_factor)
    x = moe_helpers.force_routing(moe, make_input(20), experts=[1])
    _, _, ref = moe_helpers.check_against_reference(moe, x)
    assert moe.last_stats.routed_E.tolist() == [0, 20, 0, 0]
    # Capacity ceil(cf * 20 / 4) per expert: everything past it on expert 1 is dropped.
    kept = 20 if capacity_factor is None else min(20, math.ceil(capacity_factor * 5))
    assert moe.last_stats.num_dropped == 20 - kept == int((~ref.last_keep_TK).sum())
    # All tokens on one expert: the balance loss is E * P_1, far above the uniform 1.0.
    assert moe.last_stats.balance_loss.item() > 2.0


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("router,top_k", ROUTERS)
def test_tied_gates_zero_router_and_padding_tokens_match_reference(moe_helpers, router, top_k,
                                                                   capacity_factor):
    moe = build(num_experts=8, router=router, top_k=top_k, capacity_factor=capacity_factor)
    x = make_input(2, 10)
    x[:, 6:] = 0.0  # zero padding: every gate logit ties
    moe_helpers.check_against_reference(moe.eval(), x)
    with torch.no_grad():
        moe.router.weight.zero_()  # a zero-initialised gate: every token ties
    moe_helpers.check_against_reference(moe.train(), x)
    assert moe.last_stats.routed_E[:top_k].sum() > 0


@pytest.mark.parametrize("shape", [(0,), (2, 0)], ids=["T0", "B2xS0"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("router,top_k", ROUTERS)
def test_empty_batch_runs_forward_and_backward_with_finite_aux_loss(router, top_k,
                                                                    capacity_factor, shape):
    moe = build(router=router, top_k=top_k, capacity_factor=capacity_factor, z_loss_coef=1e-2)
    x = make_input(*shape).requires_grad_(True)
    y = moe(x)
    assert y.shape == x.shape
    assert torch.isfinite(moe.last_aux_loss) and moe.last_stats.num_tokens == 0
    (y.sum() + moe.last_aux_loss).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    ref = ReferenceMoE(moe)
    assert ref(x).shape == x.shape
    torch.testing.assert_close(moe.last_aux_loss, ref.last_aux_loss)


def test_empty_batch_with_module_experts_runs_backward():
    torch.manual_seed(0)
    moe = MoE(D_MODEL, 4, 2, experts=lambda e: nn.Linear(D_MODEL, D_MODEL))
    x = make_input(0).requires_grad_(True)
    y = moe(x)
    assert y.shape == (0, D_MODEL)
    (y.sum() + moe.last_aux_loss).backward()
    assert torch.isfinite(moe.last_aux_loss)


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,expected", [
    pytest.param(dict(num_experts=4, top_k=5), ["top_k=5", "num_experts=4", "top_k <= 4"],
                 id="top_k>num_experts"),
    pytest.param(dict(num_experts=0, top_k=1), ["num_experts=0", ">= 1"], id="num_experts=0"),
    pytest.param(dict(num_experts=-3, top_k=1), ["num_experts=-3", ">= 1"], id="num_experts<0"),
    pytest.param(dict(top_k=0), ["top_k=0", ">= 1"], id="top_k=0"),
    pytest.param(dict(capacity_factor=0.0), ["capacity_factor=0.0", "> 0", "None"],
                 id="capacity_factor=0"),
    pytest.param(dict(capacity_factor=-1.5), ["capacity_factor=-1.5", "> 0"],
                 id="capacity_factor<0"),
    pytest.param(dict(capacity_factor=float("nan")), ["capacity_factor=nan"],
                 id="capacity_factor=nan"),
    pytest.param(dict(router="expert_choice"), ["expert_choice", "topk", "gshard"],
                 id="unknown_router"),
    pytest.param(dict(router="switch", top_k=2), ["top_k=2", "switch", "topk"],
                 id="switch_top_k=2"),
    pytest.param(dict(router="gshard", top_k=1), ["top_k=1", "gshard"], id="gshard_top_k=1"),
    pytest.param(dict(activation="swish"), ["activation='swish'", "gelu"],
                 id="unknown_activation"),
    pytest.param(dict(glu=True, bias=True), ["glu=True", "bias=False"], id="glu_with_bias"),
    pytest.param(dict(experts=[nn.Linear(D_MODEL, D_MODEL)] * 2, num_experts=4),
                 ["2 experts", "num_experts=4"], id="experts_list_length"),
    pytest.param(dict(experts=[]), ["experts=[]", "at least one"], id="empty_experts_list"),
    pytest.param(dict(experts=nn.Linear(D_MODEL, D_MODEL)), ["experts=Linear", "list",
                                                            "factory"], id="single_module"),
    pytest.param(dict(experts=lambda e: "mlp"), ["experts[0]", "str", "nn.Module"],
                 id="factory_returns_non_module"),
    pytest.param(dict(experts=3), ["experts=3", "factory"], id="experts_not_callable"),
    pytest.param(dict(d_ff=0), ["d_ff=0", "positive"], id="d_ff=0"),
])
def test_bad_configuration_raises_value_error_naming_argument_value_and_fix(kwargs, expected):
    kwargs = {"num_experts": 4, "top_k": 2, "d_ff": D_FF, **kwargs}
    with pytest.raises(ValueError) as info:
        MoE(D_MODEL, **kwargs)
    for text in expected:
        assert text in str(info.value), f"{text!r} missing from: {info.value}"


@pytest.mark.parametrize("x,expected", [
    pytest.param(torch.randn(3, D_MODEL + 1), ["(3, 17)", "d_model=16", "reshape"],
                 id="wrong_last_dim"),
    pytest.param(torch.randn(2, 3, 8), ["(2, 3, 8)", "d_model=16"], id="wrong_last_dim_3d"),
    pytest.param(torch.tensor(1.0), ["d_model=16"], id="scalar"),
    pytest.param(torch.ones(3, D_MODEL, dtype=torch.long), ["torch.int64", "floating point",
                                                            ".float()"], id="int_input"),
    pytest.param(torch.ones(3, D_MODEL, dtype=torch.bool), ["torch.bool", "floating point"],
                 id="bool_input"),
    pytest.param([[0.0] * D_MODEL], ["torch.Tensor", "list"], id="not_a_tensor"),
])
def test_bad_input_raises_value_error_naming_argument_value_and_fix(x, expected):
    moe = build()
    with pytest.raises(ValueError) as info:
        moe(x)
    for text in expected:
        assert text in str(info.value), f"{text!r} missing from: {info.value}"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("router,top_k", ROUTERS)
def test_non_finite_input_raises_value_error_about_router_logits(router, top_k, bad):
    moe = build(router=router, top_k=top_k)
    x = make_input(10)
    x[3, 5] = bad
    with pytest.raises(ValueError) as info:
        moe(x)
    message = str(info.value)
    for text in ("router logits", "NaN", "input"):
        assert text in message, f"{text!r} missing from: {message}"


# --- composition ----------------------------------------------------------------------------

class PreNormMoEBlock(nn.Module):
    """A pre-norm transformer block whose FFN is an MoE: x + attn(ln(x)); x + moe(ln(x))."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, num_heads=2, batch_first=True)
        self.moe = moe

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class MoEEncoderLayer(nn.TransformerEncoderLayer):
    """nn.TransformerEncoderLayer with its feed-forward block replaced by an MoE."""

    def __init__(self, moe: MoE, **kw) -> None:
        super().__init__(D_MODEL, nhead=2, dim_feedforward=D_FF, dropout=0.0, batch_first=True,
                         **kw)
        del self.linear1, self.linear2
        self.moe = moe

    def _ff_block(self, x):
        return self.moe(x)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("block", ["prenorm", "encoder_layer", "encoder_layer_norm_first"])
def test_moe_inside_transformer_block_trains_and_grads_reach_every_parameter(block, autocast):
    moe = build(router="topk", top_k=2, z_loss_coef=1e-3)
    model = {"prenorm": lambda: PreNormMoEBlock(moe),
             "encoder_layer": lambda: MoEEncoderLayer(moe),
             "encoder_layer_norm_first": lambda: MoEEncoderLayer(moe, norm_first=True)}[block]()
    x = make_input(2, 6).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
        loss = y.float().square().mean() + collect_aux_loss(model)
    assert y.shape == x.shape
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient reached {name}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_collect_aux_loss_sums_the_last_call_of_every_moe_layer():
    torch.manual_seed(0)
    first, second = build(seed=1, z_loss_coef=1e-2), build(seed=2, router="switch", top_k=1)
    model = nn.Sequential(first, nn.Linear(D_MODEL, D_MODEL), nn.GELU(), second)
    assert collect_aux_loss(model).item() == 0.0  # nothing ran yet
    for step in range(2):  # a second call replaces, never accumulates
        model(make_input(12, seed=step))
        total = collect_aux_loss(model)
        torch.testing.assert_close(total, first.last_aux_loss + second.last_aux_loss)
    total.backward()
    assert first.router.weight.grad.abs().sum() > 0 and second.router.weight.grad.abs().sum() > 0
    assert collect_aux_loss(nn.Linear(2, 2)).item() == 0.0


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("router,top_k", ROUTERS)
def test_same_seed_gives_bitwise_identical_outputs_and_grads(router, top_k, capacity_factor):
    def run():
        moe = build(router=router, top_k=top_k, capacity_factor=capacity_factor, seed=3)
        x = make_input(3, 9).requires_grad_(True)
        torch.manual_seed(11)
        y = moe(x)
        (y.square().sum() + moe.last_aux_loss).backward()
        return [y, x.grad] + [p.grad for p in moe.parameters() if p.grad is not None]
    first, second = run(), run()
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_layer_can_be_copied_or_pickled_after_a_call(how):
    moe = build()
    y = moe(make_input(8))
    if how == "deepcopy":
        twin = copy.deepcopy(moe)
    else:
        buffer = io.BytesIO()
        torch.save(moe, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert twin.last_aux_loss is None and twin.last_stats is None
    torch.testing.assert_close(twin(make_input(8)), y)
    assert moe.last_aux_loss is not None  # the original keeps its record


def test_config_object_and_keyword_arguments_build_the_same_layer():
    config = MoEConfig.from_flat(d_model=D_MODEL, num_experts=4, top_k=2, d_ff=D_FF,
                                 router="gshard", capacity_factor=1.5, glu=True)
    torch.manual_seed(0)
    from_config = MoE(config=config)
    from_kwargs = build(router="gshard", capacity_factor=1.5, glu=True)
    assert from_config.config == from_kwargs.config
    x = make_input(10)
    torch.testing.assert_close(from_config.eval()(x), from_kwargs.eval()(x))


FOUNDATION_PACKAGES = ("moescale.layers", "moescale.routing", "moescale.dispatch")


def foundation_modules():
    for package_name in FOUNDATION_PACKAGES:
        package = importlib.import_module(package_name)
        yield package
        for info in pkgutil.iter_modules(package.__path__, package_name + "."):
            yield importlib.import_module(info.name)


def test_foundation_modules_hold_no_module_level_mutable_state():
    for module in foundation_modules():
        for name, value in vars(module).items():
            if not name.startswith("__"):
                assert not isinstance(value, (list, dict, set, bytearray)), \
                    f"{module.__name__}.{name} is module-level mutable {type(value).__name__}"


def test_layers_and_routing_never_use_torch_distributed():
    for module in foundation_modules():
        if module.__name__.startswith("moescale.dispatch"):
            continue
        with open(module.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), \
                f"{module.__name__} uses torch.distributed (line {node.lineno})"


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("router,top_k", ROUTERS)
def test_activation_checkpointing_gives_the_same_output_and_grads(router, top_k, use_reentrant):
    from torch.utils.checkpoint import checkpoint
    moe = build(router=router, top_k=top_k, capacity_factor=1.0, z_loss_coef=1e-2)
    x, grad_out = make_input(20), make_input(20, seed=1)
    results = []
    for wrap in (False, True):
        moe.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        torch.manual_seed(5)  # checkpoint replays the same random draws in recompute
        if wrap:
            y, aux = checkpoint(lambda t: (moe(t), moe.last_aux_loss), x_in,
                                use_reentrant=use_reentrant)
        else:
            y, aux = moe(x_in), moe.last_aux_loss
        ((y * grad_out).sum() + aux).backward()
        results.append([y.detach(), x_in.grad] + [p.grad for p in moe.parameters()])
    for plain, checkpointed in zip(*results):
        assert torch.equal(plain, checkpointed)
