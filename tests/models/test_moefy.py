"""moefy on tiny random models built from configs (no downloads): upcycled models give the dense
outputs at conversion; a few training steps change the outputs and lower the loss."""

import pytest
import torch
from torch import nn

from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.layers.moe import MoE
from moescale.models.moefy import MoEEncoderLayer, find_ffn_blocks, moefy

transformers = pytest.importorskip("transformers")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def llama(mlp_bias=False):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=32, mlp_bias=mlp_bias)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                  num_attention_heads=2, vocab_size=64, max_position_embeddings=32,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


class EncoderLM(nn.Module):
    def __init__(self, norm_first=False):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=48, dropout=0.0,
                                           batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first)
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.enc(self.emb(input_ids)))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)) \
            if labels is not None else None
        return logits, loss


def logits_loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    if isinstance(out, tuple):
        return out
    return out.logits, out.loss


BUILDERS = {"gpt2": gpt2, "llama": llama, "llama_bias": lambda: llama(True), "bert": bert,
            "encoder": EncoderLM, "encoder_norm_first": lambda: EncoderLM(True)}
KINDS = {"gpt2": "gpt2", "llama": "gated", "llama_bias": "gated", "bert": "bert",
         "encoder": "torch_encoder", "encoder_norm_first": "torch_encoder"}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_upcycled_model_matches_dense_then_trains(name):
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    assert [kind for _, kind in find_ffn_blocks(model)] == [KINDS[name]] * 2
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        dense_logits, _ = logits_loss(model, ids)
    moefy(model, num_experts=4, top_k=2)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    expected = ModuleExperts if name == "llama_bias" else GroupedExperts
    assert all(isinstance(m.experts, expected) for m in moes)
    with torch.no_grad():
        moe_logits, _ = logits_loss(model, ids)
    torch.testing.assert_close(moe_logits, dense_logits, atol=1e-5, rtol=1e-5)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        _, loss = logits_loss(model, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(m.router.weight.grad is not None for m in moes)
    model.eval()
    with torch.no_grad():
        trained_logits, _ = logits_loss(model, ids)
    assert not torch.allclose(trained_logits, dense_logits, atol=1e-3)


def test_every_layers_and_no_upcycle():
    torch.manual_seed(0)
    model = moefy(gpt2(), num_experts=4, top_k=1, every=2, router="switch", upcycle=False)
    kinds = [type(block.mlp).__name__ for block in model.transformer.h]
    assert kinds == ["GPT2MLP", "MoEFeedForward"]
    moe = model.transformer.h[1].mlp.moe
    assert moe.experts.act.name == "gelu_tanh"   # gelu_new identified by probing
    assert not torch.equal(moe.experts.w1_EDF[0], moe.experts.w1_EDF[1])
    model = moefy(gpt2(), num_experts=4, layers=[0])
    assert type(model.transformer.h[0].mlp).__name__ == "MoEFeedForward"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_fast_path_disabled_and_padding_mask_works():
    torch.manual_seed(0)
    model = EncoderLM().eval()
    x = model.emb(torch.randint(0, 64, (2, 6)))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    with torch.no_grad():
        dense = model.enc(x, src_key_padding_mask=pad)
        moefy(model, num_experts=2, top_k=2)
        assert isinstance(model.enc.layers[0], MoEEncoderLayer)
        sparse = model.enc(x, src_key_padding_mask=pad)
    torch.testing.assert_close(sparse[0], dense[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse[1, :4], dense[1, :4], atol=1e-5, rtol=1e-5)


def test_user_errors():
    with pytest.raises(ValueError, match="no dense FFN"):
        moefy(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="renormalize"):
        moefy(gpt2(), num_experts=4, top_k=1, router="switch")
    with pytest.raises(ValueError, match="layers"):
        moefy(gpt2(), num_experts=4, layers=[5])
    with pytest.raises(ValueError, match="every"):
        moefy(gpt2(), every=0)


def test_custom_activation_and_upcycle_noise():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, dropout=0.0, batch_first=True,
                                       activation=torch.tanh)
    x = torch.randn(2, 5, 16)
    dense = layer.eval()(x).detach()
    model = moefy(nn.Sequential(layer), num_experts=3, top_k=2)
    moe = model[0].ffn
    assert moe.experts.act.spec is torch.tanh        # not a kernel name: kept as a callable
    torch.testing.assert_close(model(x), dense, atol=1e-5, rtol=1e-5)
    noisy = moefy(gpt2(), num_experts=3, upcycle_noise=0.01).transformer.h[0].mlp.moe.experts
    assert not torch.equal(noisy.w1_EDF[0], noisy.w1_EDF[1])
    torch.testing.assert_close(noisy.w1_EDF[0], noisy.w1_EDF[1], atol=0.05, rtol=0.1)
