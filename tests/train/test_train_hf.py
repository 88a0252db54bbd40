"""`moescale train --model.hf DIR` on a tiny random Mixtral that transformers saved (nothing
downloaded; grouped-query attention, 4 query heads on 2 key/value heads, as the published ones): the run starts from the checkpoint's exact weights (its first-step loss is
transformers' loss on the same batch), trains with disk-offloaded experts (`offload.mode`, the
old name of offload.tier), writes RUN_DIR/hf, which MixtralForCausalLM.from_pretrained loads with
the logits of `moescale.load_run(RUN_DIR)`; load_run, generate, export and --resume work on such
runs (also once DIR is gone), a config-only directory trains from scratch, a 2-rank expert-
parallel run exports too, and what cannot work is refused naming the option and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import moescale
from moescale import cli
from moescale.train.config import load_config
from moescale.train.metrics import read_metrics
from moescale.train.model import model_config
from train_helpers import TINY, as_argv

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
             num_experts_per_tok=2, max_position_embeddings=64)
# the run's options: TINY's loop settings, no model shape (model.hf gives it)
LOOP = {k: v for k, v in TINY.items() if not k.startswith("model.")}
IDX = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def save_mixtral(path, weights: bool = True, **kw):
    cfg = transformers.MixtralConfig(**dict(SHAPE, **kw))
    if not weights:
        cfg.save_pretrained(path)
        return path
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():     # clear-cut routing: every expert takes tokens
        for layer in model.model.layers:
            next(m for n, m in layer.named_modules() if n.endswith("gate")).weight.normal_()
    model.save_pretrained(path)
    return path


def options(corpus, run_dir, hf, steps=4, **extra) -> list[str]:
    return as_argv(dict(LOOP, **{"model.hf": str(hf), "data.path": str(corpus),
                                 "train.steps": str(steps), "train.run_dir": str(run_dir),
                                 "train.checkpoint_interval": "0", "train.eval_interval": "0"},
                        **extra))


def hf_logits(path) -> torch.Tensor:
    model, info = transformers.MixtralForCausalLM.from_pretrained(path,
                                                                  output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    with torch.no_grad():
        return model.eval()(IDX).logits


def run_logits(run_dir) -> torch.Tensor:
    model, _ = moescale.load_run(run_dir)
    with torch.no_grad():
        return model(IDX)[0]


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def disk_run(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    src = save_mixtral(root / "mixtral")
    run_dir = root / "run"
    assert cli.main(["train", *options(corpus, run_dir, src, **{"offload.mode": "disk"})]) == 0
    return src, run_dir


def test_disk_run_exports_mixtral_that_transformers_loads_with_the_runs_logits(disk_run):
    src, run_dir = disk_run
    got, want = hf_logits(run_dir / "hf"), run_logits(run_dir)
    assert max_diff(got, want) <= 1e-5, max_diff(got, want)
    assert max_diff(got, hf_logits(src)) > 1e-3      # it trained
    exported = json.loads((run_dir / "hf" / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_local_experts", "max_position_embeddings",
                "tie_word_embeddings", "router_aux_loss_coef", "rms_norm_eps"):
        assert exported[key] == source[key], key
    assert exported["rope_parameters"]["rope_theta"] == source["rope_parameters"]["rope_theta"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hf_export"] == str(run_dir / "hf")
    saved = (run_dir / "config.toml").read_text()
    assert f'hf = "{src}"' in saved and "d_model" not in saved and 'tier = "disk"' in saved


def test_the_first_step_loss_is_transformers_loss_on_the_same_batch(disk_run):
    from moescale.train.data import TokenBatches, load_data
    from moescale.train.trainer import DEFAULT_CACHE_DIR

    src, run_dir = disk_run
    _, config = moescale.load_run(run_dir)
    tc = config.train
    data = load_data(config.data, DEFAULT_CACHE_DIR)
    idx, targets = TokenBatches(data.train, tc.batch_size, tc.seq_len, tc.seed, "train").next()
    hf = transformers.MixtralForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        want = float(F.cross_entropy(hf(idx).logits.reshape(-1, 300), targets.reshape(-1)))
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train")
    assert first["step"] == 1 and abs(first["loss"] - want) <= 1e-5, (first["loss"], want)


def test_generate_export_and_load_run_work_on_the_run_also_without_its_source(
        disk_run, tmp_path, capsys):
    src, run_dir = disk_run
    assert cli.main(["generate", str(run_dir), "--prompt", "def ", "--tokens", "4"]) == 0
    assert cli.main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    assert max_diff(hf_logits(tmp_path / "out"), run_logits(run_dir)) <= 1e-5
    moved = tmp_path / "moved"       # model.hf gone: the run's copy of its config.json
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("expert-store"))
    text = (moved / "config.toml").read_text()
    (moved / "config.toml").write_text(text.replace(str(src), str(tmp_path / "gone")))
    assert torch.equal(run_logits(moved), run_logits(run_dir))


@pytest.mark.slow
def test_resume_continues_and_replaces_the_export(disk_run, tmp_path):
    src, run_dir = disk_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "expert-store").exists() and shutil.rmtree(copy / "expert-store")
    before = hf_logits(copy / "hf")
    assert cli.main(["train", "--resume", str(copy), "--train.steps", "6"]) == 0
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")
            if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    after = hf_logits(copy / "hf")
    assert max_diff(after, run_logits(copy)) <= 1e-5 and max_diff(after, before) > 0
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_a_config_only_directory_trains_from_scratch_with_its_tokenizer(corpus, tmp_path,
                                                                        capsys):
    from data_helpers import corpus_texts, save_tokenizer_json

    src = save_mixtral(tmp_path / "cfg", weights=False, tie_word_embeddings=True)
    save_tokenizer_json(corpus_texts(corpus), src, vocab_size=300)
    assert cli.main(["train", *options(corpus, tmp_path / "run", src, steps=2)]) == 0
    err = capsys.readouterr().err
    assert "config only, random initialisation" in err and "own tokenizer" in err
    _, config = moescale.load_run(tmp_path / "run")
    assert config.data.tokenizer == str(src)
    assert max_diff(hf_logits(tmp_path / "run" / "hf"), run_logits(tmp_path / "run")) <= 1e-5


@pytest.mark.slow
def test_an_expert_parallel_run_exports_the_whole_model(corpus, tmp_path):
    from moescale.train.launch import train_distributed

    src = save_mixtral(tmp_path / "mixtral")
    config = load_config(None, dict(LOOP, **{
        "model.hf": str(src), "data.path": str(corpus), "train.steps": "2",
        "train.checkpoint_interval": "0", "parallel.ep_size": "2", "offload.tier": "host"}))
    code, _ = train_distributed(config, tmp_path / "ep", 2, quiet=True)
    assert code == 0
    got, want = hf_logits(tmp_path / "ep" / "hf"), run_logits(tmp_path / "ep")
    assert max_diff(got, want) <= 1e-5 and max_diff(got, hf_logits(src)) > 1e-3


def test_what_model_hf_cannot_train_is_refused_naming_the_option(corpus, tmp_path, capsys):
    src = save_mixtral(tmp_path / "mixtral", weights=False)

    def resolve(vocab=256, **extra):
        given = dict({"model.hf": str(src), "train.seq_len": "32"}, **extra)
        return model_config(load_config(None, given), vocab)

    assert resolve(**{"model.top_k": "3", "model.aux_loss_coef": "0.02"}).moe.top_k == 3
    with pytest.raises(ValueError, match=r"model.d_model=64 .*drop --model.d_model"):
        resolve(**{"model.d_model": "64"})
    with pytest.raises(ValueError, match=r"model.size='small' .*drop --model.size"):
        resolve(**{"model.size": "small"})
    with pytest.raises(ValueError, match=r"top_k=1 has no Mixtral equivalent"):
        resolve(**{"model.top_k": "1"})
    with pytest.raises(ValueError, match=r"vocab_size 300 but the data's vocabulary is 400"):
        resolve(vocab=400)
    with pytest.raises(ValueError, match=r"train.seq_len=128 exceeds .* 64"):
        resolve(**{"train.seq_len": "128"})
    with pytest.raises(ValueError, match=r"has no config.json"):
        model_config(load_config(None, {"model.hf": str(tmp_path), "train.seq_len": "32"}), 9)
    with pytest.raises(ValueError, match=r"is not a directory"):
        model_config(load_config(None, {"model.hf": str(tmp_path / "none")}), 256)
    transformers.Qwen2MoeConfig(vocab_size=300, hidden_size=32).save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"model_type='qwen2_moe' \(a moescale GPT has no "
                                         r"shared experts\).* mixtral.*from_hf"):
        model_config(load_config(None, {"model.hf": str(tmp_path / "q")}), 256)
    small = save_mixtral(tmp_path / "small", weights=False, vocab_size=200)
    assert cli.main(["train", *options(corpus, tmp_path / "run", small)]) == 2     # bytes: 256
    err = capsys.readouterr().err
    assert "vocab_size 200 but the data's vocabulary is 256" in err and "--data.tokenizer" in err
