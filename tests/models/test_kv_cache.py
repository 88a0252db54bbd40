"""KV-cached decoding (moescale.models.kv_cache, GPT.generate / forward_cached) against the full
recompute it replaces: per-position logits of a prefill followed by one-token forwards within
1e-5 of one full forward; greedy tokens identical to `generate(kv_cache=False)` for multi-head,
grouped-query, GLU, every-other-layer MoE and batched models, for experts offloaded to the host
and disk tiers (offload_moe, a disk host cache of two records), and for a Mixtral checkpoint
that transformers wrote (whose own KV-cached greedy generate gives the same tokens); past the
window the tokens equal a full-forward reference of the documented context shift; a layer with
a capacity factor recomputes (and matches), and misuse of the cache is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from moescale.layers.moe import MoE
from moescale.models import GPT, GPTConfig
from moescale.offload import OffloadConfig, offload_moe

pytestmark = pytest.mark.timeout(120)


def gpt(**kw) -> GPT:
    torch.manual_seed(0)
    fields = dict(vocab_size=64, seq_len=32, n_layers=3, d_model=32, n_heads=4, d_ff=48,
                  num_experts=4, top_k=2)
    model = GPT(GPTConfig.from_flat(**dict(fields, **kw))).eval()
    with torch.no_grad():     # clear-cut routing: every expert takes tokens
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.weight.normal_(std=1.0)
    return model


def prompt(batch=2, length=5, seed=1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


SHAPES = [pytest.param(dict(), id="mha"),
          pytest.param(dict(n_kv_heads=2, glu=True, activation="silu"), id="gqa-glu"),
          pytest.param(dict(n_kv_heads=1), id="mqa", marks=pytest.mark.slow),
          pytest.param(dict(moe_every=2, tie_embeddings=False), id="moe-every-2",
                       marks=pytest.mark.slow)]


@pytest.mark.parametrize("kw", SHAPES)
def test_cached_logits_match_a_full_forward_and_greedy_tokens_match_recompute(kw):
    model = gpt(**kw)
    with torch.no_grad():
        out_BS = model.generate(prompt(), 24, temperature=0)
        assert torch.equal(out_BS, model.generate(prompt(), 24, temperature=0, kv_cache=False))
        full_BSV, _ = model(out_BS)
        cache = model.new_cache()
        parts = [model.forward_cached(out_BS[:, :7], cache)]
        parts += [model.forward_cached(out_BS[:, i:i + 1], cache)
                  for i in range(7, out_BS.shape[1])]
        assert cache.length == out_BS.shape[1]
        diff = float((torch.cat(parts, 1) - full_BSV).abs().max())
    assert diff <= 1e-5, diff


def context_shift_reference(model: GPT, idx_BS: torch.Tensor, n: int) -> torch.Tensor:
    """kv_cache.py's documented window, with full forwards: a full cache keeps its newest
    seq_len // 2 tokens and restarts their positions at 0."""
    window, keep = model.config.seq_len, model.config.seq_len // 2
    start = max(0, idx_BS.shape[1] - window)
    for i in range(n):
        if i and idx_BS.shape[1] - 1 - start == window:
            start = idx_BS.shape[1] - keep
        logits_BSV, _ = model(idx_BS[:, start:])
        idx_BS = torch.cat([idx_BS, logits_BSV[:, -1].argmax(-1, keepdim=True)], 1)
    return idx_BS


def test_past_the_window_the_context_shifts_as_documented():
    model = gpt(seq_len=16)
    with torch.no_grad():
        out_BS = model.generate(prompt(), 50, temperature=0)
        assert torch.equal(out_BS, context_shift_reference(model, prompt(), 50))
        # within the window: today's sliding recompute exactly
        assert torch.equal(out_BS[:, :16], model.generate(prompt(), 11, temperature=0,
                                                          kv_cache=False))
        long_BS = prompt(length=40)      # a prompt longer than the window: its newest 16
        assert torch.equal(model.generate(long_BS, 3, temperature=0),
                           model.generate(long_BS, 3, temperature=0, kv_cache=False))


def test_a_capacity_factor_falls_back_to_recompute():
    model = gpt(capacity_factor=0.5)
    assert not model.cache_exact()
    phases = []
    out_BS = model.generate(prompt(), 6, temperature=0, on_token=lambda p, *_: phases.append(p))
    assert torch.equal(out_BS, model.generate(prompt(), 6, temperature=0, kv_cache=False))
    assert phases == ["prefill"] + ["decode"] * 5


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_experts_decode_the_same_tokens(tier, tmp_path):
    model = gpt(n_kv_heads=2, glu=True, activation="silu")
    want_BS = model.generate(prompt(), 20, temperature=0, kv_cache=False)
    streamed = copy.deepcopy(model)
    layout_numel = sum(p.numel() for p in streamed.blocks[0].ffn.experts.parameters()) // 4
    cache = 2 * 4 * 4 * ((4 * layout_numel + 4095) // 4096 * 4096)   # two records
    engine = offload_moe(streamed, OffloadConfig(
        tier=tier, device="cpu", device_budget_experts=3,
        directory=str(tmp_path) if tier == "disk" else None,
        host_cache_bytes=cache if tier == "disk" else None))
    try:
        with torch.no_grad():
            got_BS = streamed.generate(prompt(), 20, temperature=0)
            cache_kv = streamed.new_cache()
            inc = torch.cat([streamed.forward_cached(got_BS[:, :5], cache_kv)] +
                            [streamed.forward_cached(got_BS[:, i:i + 1], cache_kv)
                             for i in range(5, got_BS.shape[1])], 1)
            diff = float((inc - model(got_BS)[0]).abs().max())
    finally:
        engine.close()
    assert torch.equal(got_BS, want_BS)
    assert diff <= 1e-5, diff


@pytest.mark.slow
def test_a_mixtral_checkpoint_decodes_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moescale.models.mixtral import import_mixtral

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = import_mixtral(tmp_path / "hf")
    idx_BS = prompt()
    with torch.no_grad():
        ours_BS = model.generate(idx_BS, 30, temperature=0)
        hf_BS = hf.generate(idx_BS, attention_mask=torch.ones_like(idx_BS), max_new_tokens=30,
                            min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(ours_BS, model.generate(idx_BS, 30, temperature=0, kv_cache=False))
    assert torch.equal(ours_BS, hf_BS)


def test_cache_misuse_is_refused():
    model = gpt()
    cache = model.new_cache()
    with torch.no_grad():
        model.forward_cached(prompt(), cache)
        with pytest.raises(ValueError, match="need 1 to 27"):
            model.forward_cached(prompt(length=28), cache)
        with pytest.raises(ValueError, match="reset the cache"):
            model.forward_cached(prompt(batch=3, length=1), cache)
        cache.reset()
        assert model.forward_cached(prompt(batch=3, length=1), cache).shape == (3, 1, 64)
