"""save_moefied / load_moefied (moescale.models.moefied): moefied transformers models without a
Hugging Face MoE class (GPT-2, BERT, a Llama with biased MLPs) save and load with equal outputs,
and transformers refuses the directory instead of loading it with re-initialised MLPs."""

from __future__ import annotations

import pytest
import torch

import moescale
from moescale.models.moefied import load_moefied, save_moefied

transformers = pytest.importorskip("transformers")

IDX = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=4, bos_token_id=0,
        eos_token_id=0)).eval()


def test_moefied_gpt2_saves_loads_equal_and_transformers_refuses_it(tmp_path):
    model = moescale.moefy(gpt2(), num_experts=4, top_k=2, upcycle_noise=0.5, layers=[0, 2])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(std=1.0)
    model.eval()
    out = save_moefied(model, tmp_path / "moefied")
    loaded = load_moefied(out)
    assert not loaded.training
    assert [type(b.mlp).__name__ for b in loaded.transformer.h] == \
        ["MoEFeedForward", "GPT2MLP", "MoEFeedForward"]
    with torch.no_grad():
        assert torch.equal(loaded(IDX).logits, model(IDX).logits)
    with pytest.raises(ValueError, match="moescale_moefied"):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(OSError, match="model.safetensors"):
        transformers.GPT2LMHeadModel.from_pretrained(out)


@pytest.mark.parametrize("name", ["bert", "llama-mlp-bias"])
def test_other_moefied_families_round_trip(name, tmp_path):
    torch.manual_seed(0)
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64))
        moescale.moefy(model, num_experts=4, top_k=2, upcycle_noise=0.5, layers=[1])
        output = lambda m: m(IDX).last_hidden_state      # noqa: E731
    else:      # biased gated MLPs become ModuleExperts
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, mlp_bias=True))
        moescale.moefy(model, num_experts=3, top_k=2, upcycle_noise=0.5)
        output = lambda m: m(IDX).logits      # noqa: E731
    model.eval()
    loaded = load_moefied(save_moefied(model, tmp_path / name))
    with torch.no_grad():
        assert torch.equal(output(loaded), output(model))


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="no transformers config"):
        save_moefied(torch.nn.Linear(2, 2), tmp_path / "a")
    with pytest.raises(ValueError, match="holds no moescale MoE"):
        save_moefied(gpt2(), tmp_path / "b")
    gpt2().save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="not a save_moefied directory"):
        load_moefied(tmp_path / "dense")


def test_save_pretrained_of_a_moefied_model_refuses_naming_the_faithful_savers(tmp_path):
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4)).eval()
    model = moescale.moefy(llama, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="save_moefied.*export_mixtral"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    save_moefied(model, tmp_path / "safe")
    with torch.no_grad():
        assert torch.equal(load_moefied(tmp_path / "safe")(IDX).logits, model(IDX).logits)

