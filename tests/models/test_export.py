"""Mixtral export and import (moescale.models.mixtral) on tiny random models, nothing downloaded:
a moescale GPT of a Mixtral shape and a moefied Llama are written as Mixtral checkpoint
directories that transformers' own MixtralForCausalLM.from_pretrained loads with every weight
(no missing or unexpected keys) and the same logits (fp32, max difference <= 1e-5 of the
logits' scale; grouped-query attention included); import_mixtral reads them, and transformers'
save_pretrained output (multi-head, grouped-query, multi-query), back into a GPT exactly;
shapes without a Mixtral equivalent are refused with the field named."""

from __future__ import annotations

import json

import pytest
import torch

import moescale
from moescale.layers.moe import MoE
from moescale.models import GPT, GPTConfig
from moescale.models.mixtral import export_mixtral, import_mixtral

transformers = pytest.importorskip("transformers")

IDX = dict(low=0, high=64, size=(2, 24))


def gpt(**kw) -> GPT:
    torch.manual_seed(0)
    fields = dict(vocab_size=64, seq_len=32, n_layers=2, d_model=32, n_heads=4, d_ff=48,
                  num_experts=4, top_k=2, glu=True, activation="silu", rope_theta=500.0,
                  norm_eps=1e-6)
    model = GPT(GPTConfig.from_flat(**dict(fields, **kw))).eval()
    with torch.no_grad():     # clear-cut routing: every expert takes tokens
        for block in model.blocks:
            if isinstance(block.ffn, MoE):
                block.ffn.router.weight.normal_(std=1.0)
    return model


def load_hf(path):
    model, info = transformers.MixtralForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return model.eval()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> float:
    diff = float((got - want).abs().max())
    assert diff <= rel * float(want.abs().max()), diff
    return diff


@pytest.mark.parametrize("kw", [dict(tie_embeddings=True), dict(tie_embeddings=False),
                                dict(activation="gelu", top_k=3, tie_embeddings=False),
                                dict(n_kv_heads=2, tie_embeddings=False)],
                         ids=["tied", "untied", "gelu-top3", "gqa"])
def test_gpt_exports_to_mixtral_with_equal_logits_and_imports_back(kw, tmp_path):
    model = gpt(**kw)
    out = export_mixtral(model, tmp_path / "mixtral")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["rope_parameters"]["rope_theta"] == 500.0
    hf = load_hf(out)
    assert hf.config.tie_word_embeddings == model.config.tie_embeddings
    assert hf.config.rms_norm_eps == 1e-6
    assert hf.config.num_key_value_heads == model.config.n_kv_heads
    idx = torch.randint(**IDX, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(idx)[0]
        assert_logits_close(hf(idx).logits, want)
        back = import_mixtral(out)
        assert back.config.tie_embeddings == model.config.tie_embeddings
        assert torch.equal(back(idx)[0], want)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_import_reads_transformers_own_mixtral_checkpoint(kv_heads, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=kv_heads, num_local_experts=4,
                                     max_position_embeddings=32, tie_word_embeddings=False)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = import_mixtral(tmp_path / "hf")
    assert model.config.n_kv_heads == kv_heads
    idx = torch.randint(**IDX, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_close(model(idx)[0], hf(idx).logits)


@pytest.mark.parametrize("field, value", [("glu", False), ("moe_every", 2), ("router", "noisy_topk"),
                                          ("top_k", 1), ("capacity_factor", 1.25)])
def test_gpt_without_a_mixtral_equivalent_is_refused_naming_the_field(field, value, tmp_path):
    kw = {field: value}
    if field == "glu":
        kw["activation"] = "gelu"
    with pytest.raises(ValueError, match=f"^{field}=.*Mixtral"):
        export_mixtral(gpt(**kw), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_never_overwrites_and_import_refuses_what_gpt_cannot_compute(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(ValueError, match="not an empty directory"):
        export_mixtral(gpt(), tmp_path / "full")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     sliding_window=16)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "window")
    with pytest.raises(ValueError, match="sliding_window=16"):
        import_mixtral(tmp_path / "window")
    with pytest.raises(ValueError, match="no config.json"):
        import_mixtral(tmp_path / "full")


def llama(tie: bool, kv_heads: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, max_position_embeddings=32,
                                   tie_word_embeddings=tie, rope_theta=1234.0,
                                   rms_norm_eps=1e-6)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("tie, kv_heads", [(True, 2), (False, 1)], ids=["tied-gqa", "untied-mqa"])
def test_moefied_llama_exports_to_mixtral_with_equal_logits(tie, kv_heads, tmp_path):
    model = moescale.moefy(llama(tie, kv_heads), num_experts=4, top_k=2, upcycle_noise=0.5)
    with torch.no_grad():     # experts differ (noise) and the router picks among them
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(std=1.0)
    model.eval()
    hf = load_hf(export_mixtral(model, tmp_path / "mixtral"))
    assert hf.config.num_key_value_heads == kv_heads
    idx = torch.randint(**IDX, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_logits_close(hf(idx).logits, model(idx).logits)


def test_moefied_models_without_a_mixtral_equivalent_are_refused(tmp_path):
    half = moescale.moefy(llama(True, 2), num_experts=4, top_k=2, every=2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp is not an MoE"):
        export_mixtral(half, tmp_path / "a")
    switch = moescale.moefy(llama(True, 2), num_experts=4, top_k=1, router="switch",
                            upcycle=False)
    with pytest.raises(ValueError, match="router"):
        export_mixtral(switch, tmp_path / "b")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="model_type='gpt2'.*save_moefied"):
        export_mixtral(moescale.moefy(gpt2, num_experts=4), tmp_path / "c")
    assert not any((tmp_path / n).exists() for n in "abc")
