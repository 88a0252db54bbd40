"""Every moescale GPT exports to a directory transformers loads (models/export_hf.py): shapes
without a Mixtral equivalent (GELU/ReLU experts, switch / gshard / noisy_topk routers, a
capacity factor that drops tokens, dense layers between MoE layers, biases, grouped-query
heads, untied embeddings) as remote code that AutoModelForCausalLM loads with every weight and
moescale's logits (fp32, within 1e-5), a Mixtral shape as transformers' own Mixtral; greedy
generation through transformers' generate (KV cache) gives moescale's tokens, left-padded
batches included."""

from __future__ import annotations

import json

import pytest
import torch

from moescale.layers.moe import MoE
from moescale.models import GPT
from moescale.models.export_hf import export_hf

transformers = pytest.importorskip("transformers")

from test_export import gpt as mixtral_shaped

SHAPES = {"gelu": dict(), "gqa-untied": dict(n_kv_heads=2, tie_embeddings=False),
          "switch-capacity": dict(router="switch", top_k=1, capacity_factor=1.0),
          "dense-every-2-bias-relu": dict(moe_every=2, bias=True, activation="relu"),
          "noisy": dict(router="noisy_topk"),
          "gshard-capacity": dict(router="gshard", capacity_factor=0.8),
          "mixtral": dict(glu=True, activation="silu")}
IDX = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))


def gpt(**kw) -> GPT:
    """test_export's tiny GPT, GELU experts unless `kw` says otherwise."""
    return mixtral_shaped(**dict(dict(glu=False, activation="gelu"), **kw))


def load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return model.eval()


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shape_loads_in_transformers_with_moescales_logits_and_greedy_tokens(name,
                                                                                  tmp_path):
    model = gpt(**SHAPES[name])
    out, fmt = export_hf(model, tmp_path / "out")
    assert fmt == ("mixtral" if name == "mixtral" else "moescale")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("mixtral" if name == "mixtral" else "moescale_gpt")
    hf = load(out)
    with torch.no_grad():
        want = model(IDX)[0]
        dropped = sum(m.last_stats.num_dropped for m in model.modules() if isinstance(m, MoE))
        got = hf(IDX).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    if "capacity" in name:
        assert dropped > 0          # the capacity rule is exercised, not only the routing
    prompt = IDX[:1, :6]
    tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, model.generate(prompt, 12, temperature=0))


def test_left_padded_batches_generate_what_each_prompt_does_alone(tmp_path):
    model = gpt()
    hf = load(export_hf(model, tmp_path / "out")[0])
    short, long = IDX[0, :4], IDX[1, :9]
    ids = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), short]), long])
    mask = torch.stack([torch.cat([torch.zeros(5), torch.ones(4)]), torch.ones(9)]).long()
    both = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for row, prompt in enumerate((short, long)):
        alone = model.generate(prompt[None], 8, temperature=0)[0, len(prompt):]
        assert torch.equal(both[row, 9:], alone)


def test_mixtral_is_refused_when_asked_for_a_shape_it_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="^glu=False has no Mixtral equivalent"):
        export_hf(gpt(), tmp_path / "out", "mixtral")
    assert not (tmp_path / "out").exists()
    out, fmt = export_hf(gpt(glu=True, activation="silu"), tmp_path / "remote", "moescale")
    assert fmt == "moescale" and (out / "modeling_moescale_gpt.py").is_file()
