"""A run leaves as a Hugging Face directory with its tokenizer (train/hf_export.py, `moescale
export`): the default run (GELU experts, byte tokens) and a GLU run each write RUN_DIR/hf at
the end, which AutoModelForCausalLM and AutoTokenizer load (remote code for GELU, transformers'
own Mixtral for GLU) with `load_run`'s logits (fp32, within 1e-5) and a tokenizer that encodes
as the run did; transformers' generate gives text; `moescale export` writes the same, refuses
`--format mixtral` for a GELU run naming the option. A run on its own tokenizer.json exports
that tokenizer with its end-of-text id, and, moved elsewhere with the original tokenizer
deleted, still generates, exports and resumes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moescale
from moescale import cli
from train_helpers import TINY, as_argv

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPT = "def main(args):\n    return"


def train(corpus, run_dir, steps=4, **extra) -> None:
    argv = as_argv(dict(TINY, **{"data.path": str(corpus), "train.steps": str(steps),
                                 "train.run_dir": str(run_dir), "train.eval_interval": "0",
                                 "train.checkpoint_interval": "2"}, **extra))
    assert cli.main(["train", *argv]) == 0


def check_export(out, run_dir, remote: bool):
    """The directory loads with the run's logits; returns (model, tokenizer)."""
    trust = {"trust_remote_code": True} if remote else {}
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 **trust)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    assert type(hf).__name__ == ("MoescaleGPTForCausalLM" if remote else "MixtralForCausalLM")
    tok = transformers.AutoTokenizer.from_pretrained(out, **trust)
    model, config = moescale.load_run(run_dir)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(ids)[0]
        diff = float((hf.eval()(ids).logits - want).abs().max())
    assert diff <= 1e-5 * float(want.abs().max()), diff
    text = tok.decode(hf.generate(ids, max_new_tokens=16, do_sample=True, top_k=40)[0])
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    return hf, tok


def test_the_default_gelu_run_leaves_as_remote_code_with_its_byte_tokenizer(corpus, tmp_path):
    run_dir = tmp_path / "run"
    train(corpus, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hf_export"] == str(run_dir / "hf")
    _, tok = check_export(run_dir / "hf", run_dir, remote=True)
    text = "héllo, wörld\t€ 🙂\n"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    gen = json.loads((run_dir / "hf" / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["top_k"] == 40
    assert cli.main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    check_export(tmp_path / "out", run_dir, remote=True)
    assert cli.main(["export", str(run_dir), str(tmp_path / "m"), "--format", "mixtral"]) == 2
    assert not (tmp_path / "m").exists()


def test_a_glu_run_leaves_as_transformers_own_mixtral(corpus, tmp_path):
    run_dir = tmp_path / "run"
    train(corpus, run_dir, **{"model.glu": "true", "model.activation": "silu"})
    config = json.loads((run_dir / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and "auto_map" not in config
    check_export(run_dir / "hf", run_dir, remote=False)


def bpe_tokenizer(corpus, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    tok.save(str(path))
    return path


def test_a_run_on_its_own_tokenizer_exports_it_and_moves_with_it(corpus, tmp_path):
    (tmp_path / "tok").mkdir()
    tok_file = bpe_tokenizer(corpus, tmp_path / "tok" / "tokenizer.json")
    run_dir = tmp_path / "run"
    train(corpus, run_dir, **{"data.tokenizer": str(tok_file)})
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    ours = tokenizers.Tokenizer.from_file(str(tok_file))
    _, tok = check_export(run_dir / "hf", run_dir, remote=True)
    assert tok(PROMPT)["input_ids"] == ours.encode(PROMPT).ids
    eos = ours.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == eos
    assert json.loads((run_dir / "hf" / "generation_config.json").read_text())[
        "eos_token_id"] == eos
    moved = tmp_path / "elsewhere" / "run"
    shutil.move(run_dir, moved)
    shutil.rmtree(tmp_path / "tok")
    assert cli.main(["generate", str(moved), "--prompt", "def ", "--tokens", "5"]) == 0
    assert cli.main(["export", str(moved), str(tmp_path / "out")]) == 0
    assert cli.main(["train", "--resume", str(moved), "--train.steps", "6"]) == 0
    assert [json.loads(x)["step"] for x in (moved / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)][-1] == 6


def test_the_end_of_run_export_is_skipped_with_a_note_when_the_model_exceeds_ram(tmp_path):
    import io

    from moescale.train.hf_export import end_of_run_export

    run_dir, out, summary = tmp_path / "run", io.StringIO(), {}
    end_of_run_export(run_dir, summary, out, num_params=1 << 50)
    assert "skipped" in out.getvalue() and f"moescale export {run_dir} OUT" in out.getvalue()
    assert not run_dir.exists() and "hf_export" not in summary
