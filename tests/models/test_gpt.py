"""Tests for the MoE GPT language model and its named sizes (tiny dims; sizes counted on meta)."""

import pytest
import torch

from moescale.layers.moe import MoE
from moescale.models import GPT, GPTConfig, count_parameters, gpt_config
from moescale.models.gpt import DenseFFN


def micro(**kw):
    fields = dict(vocab_size=32, seq_len=16, n_layers=2, d_model=16, n_heads=2, d_ff=32,
                  num_experts=4, top_k=2)
    fields.update(kw)
    return GPTConfig.from_flat(**fields)


# ES-MoE table (total parameters); we accept 3 %.
PAPER = [("moe-s", 8, 521e6), ("moe-s", 64, 3.70e9), ("moe-m", 8, 1.76e9), ("moe-l", 8, 3.93e9)]


@pytest.mark.parametrize("name,experts,paper", PAPER)
def test_es_moe_parameter_counts_match_paper(name, experts, paper):
    count = count_parameters(gpt_config(name, num_experts=experts))
    assert abs(count.total - paper) / paper < 0.03, (name, experts, count.total)


@pytest.mark.parametrize("name,experts,paper", PAPER)
def test_meta_count_matches_arithmetic(name, experts, paper):
    cfg = gpt_config(name, num_experts=experts)
    D, F, L, E, V = cfg.d_model, cfg.moe.d_ff, cfg.n_layers, cfg.moe.num_experts, cfg.vocab_size
    per_layer = 4 * D * D + E * 2 * D * F + E * D + 2 * D   # attn + experts + router + norms
    expected = L * per_layer + V * D + D                     # + tied embedding + final norm
    count = count_parameters(cfg)
    assert count.total == expected
    assert count.expert == L * E * 2 * D * F
    assert count.active == expected - L * (E - cfg.moe.top_k) * 2 * D * F


def test_forward_shapes_loss_and_backward():
    torch.manual_seed(0)
    model = GPT(micro())
    idx = torch.randint(0, 32, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 32) and loss is None
    logits, loss = model(idx, idx)
    parts = model.last_loss_parts
    assert torch.allclose(loss.detach(), parts["ce"] + parts["aux"])
    assert parts["aux"] > 0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(micro()).eval()
    idx = torch.randint(0, 32, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 32
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_moe_every_and_tied_embeddings():
    model = GPT(micro(n_layers=4, moe_every=2, tie_embeddings=False, glu=True,
                      activation="silu"))
    kinds = [type(b.ffn) for b in model.blocks]
    assert kinds == [DenseFFN, MoE, DenseFFN, MoE]
    assert model.lm_head.weight is not model.tok_emb.weight
    tied = GPT(micro())
    assert tied.lm_head.weight is tied.tok_emb.weight
    dense = GPT(micro(moe_every=0))
    assert not any(isinstance(m, MoE) for m in dense.modules())
    count = dense.num_parameters()
    assert count.expert == 0 and count.active == count.total


def test_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = GPT(micro(dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 32, (4, 16))
    losses = []
    for _ in range(15):
        _, loss = model(idx, idx.roll(-1, dims=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_generate_appends_tokens_and_restores_mode():
    torch.manual_seed(0)
    model = GPT(micro()).train()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 20, top_k=5)
    assert out.shape == (2, 23) and model.training
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0)
    assert torch.equal(greedy, model.generate(torch.zeros(1, 3, dtype=torch.long), 4,
                                              temperature=0))


@pytest.mark.parametrize("kw,word", [
    (dict(d_model=15), "n_heads"), (dict(top_k=5), "top_k"), (dict(moe_every=-1), "moe_every"),
    (dict(activation="tanh"), "activation"), (dict(dropout=1.0), "dropout"),
    (dict(d_model=12, n_heads=4), "even"), (dict(vocab_size=0), "vocab_size")])
def test_config_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        micro(**kw)


def test_user_errors():
    model = GPT(micro())
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="unknown"):
        gpt_config("huge")
    with pytest.raises(ValueError, match="n_layer"):
        gpt_config("tiny", n_layer=3)
