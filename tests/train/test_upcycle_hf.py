"""`moescale train --model.hf DENSE_DIR`: a dense Llama / Mistral / Qwen2 that transformers
built and saved (tiny, random, nothing downloaded) is upcycled to an MoE (every expert a copy
of its layer's MLP): at step 0 it computes the dense model's logits; 20 steps from the CLI
train it, and RUN_DIR/hf reloads in transformers with `load_run`'s logits (Llama as Mixtral,
Qwen2's q/k/v biases as remote code; Mistral with disk-tier experts, each filled from the dense
MLP one at a time); the expert count is the run's option; a dense family the
GPT cannot hold is refused naming moefy."""

from __future__ import annotations

import json

import pytest
import torch

import moescale
from moescale import cli
from moescale.train.config import load_config
from moescale.train.model import build_model, load_hf_weights
from train_helpers import TINY, as_argv

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LOOP = {k: v for k, v in TINY.items() if not k.startswith("model.")}
IDX = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def save_dense(path, family: str, **kw):
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(0)
    model = model_cls(config_cls(**dict(SHAPE, **kw))).eval()
    model.save_pretrained(path)
    return model


def options(corpus, run_dir, hf, steps, **extra):
    return as_argv(dict(LOOP, **{"model.hf": str(hf), "data.path": str(corpus),
                                 "train.steps": str(steps), "train.run_dir": str(run_dir),
                                 "train.checkpoint_interval": "0", "train.eval_interval": "0"},
                        **extra))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_upcycled_model_computes_the_dense_models_logits(family, corpus, tmp_path):
    dense = save_dense(tmp_path / "dense", family, tie_word_embeddings=family == "qwen2")
    config = load_config(None, {"model.hf": str(tmp_path / "dense"), "data.path": str(corpus),
                                "model.num_experts": "4", "model.top_k": "2",
                                "train.seq_len": "32"})
    model = build_model(config, 256)
    assert "upcycled" in load_hf_weights(model, config)
    assert model.config.moe.num_experts == 4 and model.config.qkv_bias == (family == "qwen2")
    with torch.no_grad():
        want = dense(IDX).logits
        got = model.eval()(IDX)[0]
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("family, fmt, tier", [("llama", "mixtral", "device-only"),
                                               ("qwen2", "moescale_gpt", "device-only"),
                                               ("mistral", "mixtral", "disk")])
def test_a_dense_model_upcycles_trains_and_exports_from_the_cli(family, fmt, tier, corpus,
                                                                tmp_path, capsys):
    dense = save_dense(tmp_path / "dense", family)
    run_dir = tmp_path / "run"
    argv = options(corpus, run_dir, tmp_path / "dense", 20, **{"model.num_experts": "4",
                                                               "offload.tier": tier})
    assert cli.main(["train", *argv]) == 0
    assert "holds no tokenizer" in capsys.readouterr().err     # bytes, said, not silent
    config = json.loads((run_dir / "hf" / "config.json").read_text())
    assert config["model_type"] == fmt and config.get("num_local_experts", 4) == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf",
                                                           trust_remote_code=True).eval()
    model, _ = moescale.load_run(run_dir)
    with torch.no_grad():
        want = model(IDX)[0]
        assert float((hf(IDX).logits - want).abs().max()) <= 1e-5 * float(want.abs().max())
        assert float((dense(IDX).logits - want).abs().max()) > 1e-3      # it trained


def test_a_dense_family_the_gpt_cannot_hold_is_refused_naming_moefy(corpus, tmp_path):
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")
    config = load_config(None, {"model.hf": str(tmp_path / "gpt2"), "data.path": str(corpus)})
    with pytest.raises(ValueError, match="model_type='gpt2'.*moescale.moefy"):
        build_model(config, 256)
