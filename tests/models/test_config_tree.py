"""The nested model config (moescale/config_tree.py): GPTConfig holds an MoEConfig, which holds a
RouterConfig, each field declared once; flat keys (sizes, MoE's keywords, the run's model
options) build the same tree as nested construction, go back by to_flat, and bad keys are
refused naming them; every model option of a run is a flat key of the tree."""

from __future__ import annotations

import dataclasses

import pytest

from moescale import MoE
from moescale.config_tree import flat_names
from moescale.layers.moe import MoEConfig
from moescale.models import GPT, GPTConfig, gpt_config
from moescale.routing.config import RouterConfig
from moescale.train.config import ModelSection

ROUTER = ("kind", "num_experts", "top_k", "renormalize", "jitter_eps", "noise_std_min",
          "random_routing")


def test_each_field_is_declared_once_and_the_tree_nests():
    assert tuple(f.name for f in dataclasses.fields(RouterConfig)) == ROUTER
    moe_fields = {f.name for f in dataclasses.fields(MoEConfig)}
    gpt_fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert not (moe_fields | gpt_fields) & (set(ROUTER) - {"kind"})
    assert moe_fields & gpt_fields == {"d_model", "bias"}      # one value, checked to agree
    cfg = GPTConfig()
    assert isinstance(cfg.moe, MoEConfig) and isinstance(cfg.moe.router, RouterConfig)
    assert (cfg.moe.d_model, cfg.moe.d_ff, cfg.moe.num_experts, cfg.moe.top_k) == (128, 512, 8, 2)


def test_flat_keys_build_what_nested_construction_builds_and_go_back():
    flat = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=2, num_experts=4, top_k=1,
                router="switch", capacity_factor=1.25, jitter_eps=0.05, glu=True,
                activation="silu", aux_loss_coef=0.02)
    built = GPTConfig.from_flat(**flat)
    nested = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, moe=MoEConfig(
        d_model=32, capacity_factor=1.25, glu=True, activation="silu", aux_loss_coef=0.02,
        router=RouterConfig(kind="switch", num_experts=4, top_k=1, jitter_eps=0.05)))
    assert built == nested
    back = built.to_flat()
    assert set(back) == set(flat_names(GPTConfig)) and {k: back[k] for k in flat} == flat
    assert GPTConfig.from_flat(**back) == built
    whole = GPTConfig.from_flat(d_model=32, n_heads=2, router=nested.moe.router)
    assert whole.moe.router == nested.moe.router
    moe = MoE(32, 4, 1, router="switch", capacity_factor=1.25, jitter_eps=0.05)
    assert moe.config.router == nested.moe.router and moe.config.num_experts == 4
    layer = GPT(built).blocks[0].ffn
    assert layer.config is built.moe and layer.router.config is built.moe.router


def test_sizes_and_run_options_are_flat_keys():
    assert set(ModelSection.shape_fields()) <= set(flat_names(GPTConfig))
    cfg = gpt_config("tiny", num_experts=16, router="noisy_topk", d_ff=96)
    assert (cfg.moe.num_experts, cfg.moe.router.kind, cfg.moe.d_ff) == (16, "noisy_topk", 96)


@pytest.mark.parametrize("call,message", [
    (lambda: GPTConfig.from_flat(expert_count=4),
     r"unknown GPTConfig field\(s\) \['expert_count'\]"),
    (lambda: gpt_config("tiny", nope=1), r"unknown GPTConfig field\(s\) \['nope'\] in overrides"),
    (lambda: MoE(16, 4, 2, bogus=1), r"unknown MoEConfig field\(s\) \['bogus'\]"),
    (lambda: GPTConfig.from_flat(num_experts=3, moe=MoEConfig(d_model=128)),
     "num_experts=3 disagrees with the num_experts=8"),
    (lambda: GPTConfig(d_model=64, moe=MoEConfig(d_model=32)),
     "moe.d_model=32 differs from d_model=64"),
    (lambda: GPTConfig(bias=True, moe=MoEConfig(d_model=128)),
     "moe.bias=False differs from bias=True"),
    (lambda: MoEConfig(d_model=8, router="switch"), "router='switch' must be a RouterConfig"),
    (lambda: MoEConfig.from_flat(num_experts=4), "MoEConfig: .*d_model"),
    (lambda: GPTConfig.from_flat(num_experts=2, top_k=3), "top_k=3 is larger than num_experts=2"),
])
def test_bad_keys_are_refused_naming_them(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_router_field_only_the_tree_sets_reaches_the_exports():
    """renormalize (a RouterConfig field the flat GPTConfig never had) off: Mixtral cannot
    express it, the remote-code config.json carries it."""
    from moescale.models.export_hf import gpt_to_moescale_hf
    from moescale.models.mixtral import check_gpt

    shape = dict(vocab_size=32, seq_len=8, n_layers=1, d_model=16, n_heads=2, num_experts=4,
                 glu=True, activation="silu")
    check_gpt(GPTConfig.from_flat(**shape))
    off = GPTConfig.from_flat(**shape, renormalize=False)
    with pytest.raises(ValueError, match="renormalize=False has no Mixtral equivalent"):
        check_gpt(off)
    assert gpt_to_moescale_hf(GPT(off))[0]["renormalize"] is False
