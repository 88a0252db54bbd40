"""Hugging Face MoE import/export on tiny random models built from configs (no downloads):
converted models give the original logits and gradients (fp32, atol 1e-5); export is exact."""

import copy

import pytest
import torch

from moescale.layers.moe import MoE, collect_aux_loss
from moescale.models.hf import HFMoEBlock, from_hf, hf_state_dict, hf_to_grouped, to_hf

transformers = pytest.importorskip("transformers")

COMMON = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=64, max_position_embeddings=32, num_experts_per_tok=2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def mixtral():
    return transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4)


def qwen2_moe():
    return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=48, num_experts=4,
                                       decoder_sparse_step=1, norm_topk_prob=False)


def qwen3_moe():
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24,
                                       num_experts=4, norm_topk_prob=True, head_dim=16)


def olmoe():
    return transformers.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4)


CONFIGS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe}


def build(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).float().eval()
    with torch.no_grad():   # clear-cut routing, and expert outputs large enough to matter
        for n, p in model.named_parameters():
            if n.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.normal_(std=1.0 if n.endswith("gate.weight") else 0.2)
    return model


def grads_in_hf_layout(model):
    grads = {n: p.grad for n, p in model.named_parameters()}
    for path, m in model.named_modules():
        if isinstance(m, HFMoEBlock):
            ex = m.moe.experts
            gate_up = torch.cat([ex.w1_EDF.grad, ex.w3_EDF.grad], 2).transpose(1, 2)
            grads[f"{path}.experts.gate_up_proj"] = gate_up
            grads[f"{path}.experts.down_proj"] = ex.w2_EFD.grad.transpose(1, 2)
            grads[f"{path}.gate.weight"] = m.moe.router.weight.grad
    return grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_matches_logits_and_gradients(name):
    model = build(name)
    ids = torch.randint(0, 64, (2, 10))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}

    ours = from_hf(copy.deepcopy(model))
    ours.zero_grad(set_to_none=True)
    moes = [m for m in ours.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    assert moes[0].config.router.renormalize_scores == \
        (name in ("mixtral", "qwen3_moe"))
    out = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    got = grads_in_hf_layout(ours)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got[n], g, atol=1e-5, rtol=1e-4, msg=n)
    assert collect_aux_loss(ours) > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_reimport_exact_and_from_pretrained(name, tmp_path):
    model = build(name)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    ours = from_hf(model)
    imported = {k: v.clone() for k, v in ours.state_dict().items()}
    assert hf_state_dict(ours).keys() == original.keys()
    for k, v in hf_state_dict(ours).items():
        assert torch.equal(v, original[k]), k

    to_hf(ours)
    state = ours.state_dict()
    assert state.keys() == original.keys()
    for k, v in state.items():
        assert torch.equal(v, original[k]), k
    from_hf(ours)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, imported[k]), k

    to_hf(ours).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref, atol=1e-6, rtol=1e-6)


def test_trained_weights_survive_export():
    model = from_hf(build("qwen2_moe"))
    ids = torch.randint(0, 64, (2, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(input_ids=ids, labels=ids)
    (out.loss + collect_aux_loss(model)).backward()
    opt.step()
    block = model.model.layers[0].mlp
    w1, w3, w2 = (t.clone() for t in (block.moe.experts.w1_EDF, block.moe.experts.w3_EDF,
                                       block.moe.experts.w2_EFD))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    to_hf(model)
    hf_block = model.model.layers[0].mlp
    assert type(hf_block).__name__ == "Qwen2MoeSparseMoeBlock"
    for a, b in zip(hf_to_grouped(hf_block.experts.gate_up_proj, hf_block.experts.down_proj),
                    (w1, w3, w2)):
        assert torch.equal(a, b)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_user_errors():
    with pytest.raises(ValueError, match="no sparse MoE block"):
        from_hf(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="no HFMoEBlock"):
        to_hf(build("olmoe"))
    cfg = mixtral()
    cfg.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise"):
        from_hf(transformers.MixtralForCausalLM(cfg))
