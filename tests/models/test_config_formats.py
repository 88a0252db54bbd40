"""The on-disk formats that hold a model's configuration stay readable across the nesting of
GPTConfig -> MoEConfig -> RouterConfig: a run directory written by f62ced3's code (flat
config.toml, its step-1 checkpoint) loads into the same model (its logits equal the ones that
code computed), and the remote-code export's config.json holds every key that code wrote,
with its value, for a run's model and for a GPT with non-default fields (fixtures/f62ced3,
written by make_fixture.py there)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import moescale
from moescale.models import GPT, GPTConfig
from moescale.models.export_hf import gpt_to_moescale_hf

FIXTURES = Path(__file__).parent / "fixtures" / "f62ced3"
NOT_CONFIG = ("architectures", "auto_map", "model_type", "dtype", "use_cache",
              "tie_word_embeddings", "eos_token_id")


def _flat(config_json: dict) -> dict:
    """The GPTConfig fields of a remote-code config.json (top_k under transformers' name)."""
    fields = {k: v for k, v in config_json.items() if k not in NOT_CONFIG}
    fields["top_k"] = fields.pop("num_experts_per_tok")
    return fields


def test_a_run_written_by_f62ced3_loads_with_its_logits(tmp_path):
    run_dir = shutil.copytree(FIXTURES / "run", tmp_path / "run")
    model, config = moescale.load_run(run_dir)
    assert config.model.glu is True and config.model.capacity_factor == 2.0
    want = torch.load(FIXTURES / "run_logits.pt")
    with torch.no_grad():
        got = model(want["idx"])[0]
    torch.testing.assert_close(got, want["logits"], rtol=1e-5, atol=1e-6)
    written = json.loads((FIXTURES / "run_hf_config.json").read_text())
    config_json, _ = gpt_to_moescale_hf(model)
    assert {k: config_json[k] for k in written if k != "eos_token_id"} == \
        {k: v for k, v in written.items() if k != "eos_token_id"}


def test_the_remote_code_config_json_keeps_its_keys():
    """Every key f62ced3 wrote, with its value; added: the router fields a GPTConfig now holds
    (at their defaults here), which the flat GPTConfig could not set."""
    written = json.loads((FIXTURES / "moescale_gpt_config.json").read_text())
    cfg = GPTConfig.from_flat(**_flat(written))
    assert cfg.moe.router.kind == "gshard" and cfg.moe.bias and cfg.moe.d_ff == 24
    config_json = json.loads(json.dumps(gpt_to_moescale_hf(GPT(cfg))[0]))
    assert {k: config_json[k] for k in written} == written
    assert {k: v for k, v in config_json.items() if k not in written} == dict(
        renormalize=None, jitter_eps=0.01, noise_std_min=0.0, random_routing=True)
