"""moescale.load_run, `moescale generate` and `moescale export` on real `moescale train` runs:
the loaded model is the trained one (resident: identical logits; disk-offloaded and 2-rank
expert-parallel runs load into a plain resident GPT with the resident run's logits within 1e-4),
a damaged newest checkpoint falls back to the previous one, the generate command prints a
seeded continuation (decoded through the run's data.tokenizer when it has one), and export
writes a Mixtral checkpoint transformers loads with equal logits (or refuses a run whose model
has no Mixtral shape, exit 2, naming the option)."""

from __future__ import annotations

import pytest
import torch

import moescale
from moescale import cli
from moescale.train.trainer import Trainer
from train_helpers import tiny_run_config

GLU = {"model.glu": "true", "model.activation": "silu"}
IDX = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def train(corpus, run_dir, steps=2, every=2, keep_last=1, **extra) -> Trainer:
    trainer = Trainer(tiny_run_config(corpus, run_dir, steps=steps, every=every,
                                      keep_last=keep_last, **extra), run_dir,
                      out=open("/dev/null", "w"))
    assert trainer.run() == 0
    return trainer


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDX)[0]


@pytest.fixture(scope="module")
def resident(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resident") / "run"
    return run_dir, logits(train(corpus, run_dir, **GLU).model)


def test_load_run_gives_the_trained_model_and_refuses_what_is_not_a_run(resident, tmp_path):
    run_dir, want = resident
    model, config = moescale.load_run(run_dir)
    assert not model.training and config.model.glu is True
    assert torch.equal(logits(model), want)
    with pytest.raises(ValueError, match="does not exist"):
        moescale.load_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.toml"):
        moescale.load_run(tmp_path / "empty")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.toml").write_text((run_dir / "config.toml").read_text())
    with pytest.raises(ValueError, match="holds no checkpoint"):
        moescale.load_run(tmp_path / "fresh")
    with pytest.raises(ValueError, match=r"step=7: .* steps \[2\]"):
        moescale.load_run(run_dir, step=7)


def test_generate_prints_a_seeded_continuation(resident, capsys):
    run_dir, _ = resident
    args = ["generate", str(run_dir), "--prompt", "def ", "--tokens", "12", "--seed", "5"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first
    model, _ = moescale.load_run(run_dir)
    greedy = model.generate(torch.tensor([list(b"def ")]), 12, temperature=0)[0, 4:].tolist()
    assert cli.main(args + ["--temperature", "0"]) == 0
    assert capsys.readouterr().out == bytes(greedy).decode("utf-8", errors="replace") + "\n"
    assert cli.main(["generate", str(run_dir), "--prompt", "x", "--tokens", "-1"]) == 2
    assert "--tokens=-1" in capsys.readouterr().err
    # torch threads: --threads, else chosen from the load like train.threads
    assert cli.main(args + ["--threads", "1"]) == 0 and torch.get_num_threads() == 1
    assert capsys.readouterr().out == first
    assert cli.main(args + ["--threads", "4096"]) == 2
    assert "--threads=4096 is more than the" in capsys.readouterr().err


def test_export_writes_mixtral_that_transformers_loads_with_equal_logits(resident, tmp_path,
                                                                           capsys):
    transformers = pytest.importorskip("transformers")
    run_dir, want = resident
    assert cli.main(["export", str(run_dir), str(tmp_path / "mixtral")]) == 0
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "mixtral").eval()
    with torch.no_grad():
        diff = float((hf(IDX).logits - want).abs().max())
    assert diff <= 1e-5 * float(want.abs().max()), diff


@pytest.mark.slow
def test_export_as_mixtral_refuses_a_run_without_mixtral_shape(corpus, tmp_path, capsys):
    train(corpus, tmp_path / "gelu", steps=1, every=1)       # the default: GELU experts
    assert cli.main(["export", str(tmp_path / "gelu"), str(tmp_path / "out"),
                     "--format", "mixtral"]) == 2
    err = capsys.readouterr().err
    assert "glu=False" in err and "--model.glu true" in err and "--format moescale" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_offloaded_and_expert_parallel_runs_load_into_a_resident_gpt(corpus, resident, tmp_path):
    from moescale.train.launch import train_distributed

    run_dir, want = resident
    train(corpus, tmp_path / "disk", **GLU, **{"offload.mode": "disk",
                                              "offload.host_cache": "256KiB"})
    config = tiny_run_config(corpus, tmp_path / "ep", steps=2, every=2, keep_last=1,
                             **GLU, **{"parallel.ep_size": "2"})
    code, _ = train_distributed(config, tmp_path / "ep", 2, quiet=True)
    assert code == 0
    for name in ("disk", "ep"):
        model, _ = moescale.load_run(tmp_path / name)
        assert type(model.blocks[0].ffn.experts).__name__ == "GroupedExperts"
        got = logits(model)
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), name


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["expert shard",
                                     pytest.param("dense DCP file", marks=pytest.mark.slow)])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(corpus, tmp_path, capsys,
                                                               damaged):
    run_dir = tmp_path / "run"
    train(corpus, run_dir, steps=4, every=2, keep_last=2, **GLU)
    ckpt = run_dir / "checkpoints"
    shard = next((ckpt / "expert-shards-00000004").rglob("*.safetensors")) \
        if damaged == "expert shard" else next(ckpt.glob("dense-00000004-*/__0_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[-8:] = bytes(8)
    shard.write_bytes(bytes(data))
    model, _ = moescale.load_run(run_dir)
    err = capsys.readouterr().err
    assert "trying the previous checkpoint" in err
    assert damaged == "expert shard" or f"{str(shard)!r} failed its checksum" in err
    previous, _ = moescale.load_run(run_dir, step=2)
    assert torch.equal(logits(model), logits(previous))
    with pytest.raises(ValueError):
        moescale.load_run(run_dir, step=4)


@pytest.mark.slow
def test_generate_decodes_through_the_runs_tokenizer(corpus, tmp_path, capsys):
    from data_helpers import corpus_texts, save_tokenizer_json
    from moescale.train.load_run import run_tokenizer
    from moescale.train.tokenizer import load_tokenizer

    tok_path = save_tokenizer_json(corpus_texts(corpus), tmp_path / "tok")
    run_dir = tmp_path / "run"
    train(corpus, run_dir, steps=1, every=1, **{"data.tokenizer": str(tok_path)})
    model, config = moescale.load_run(run_dir)
    tokenizer = load_tokenizer(tok_path)
    assert run_tokenizer(config).fingerprint == tokenizer.fingerprint
    assert model.config.vocab_size == tokenizer.vocab_size
    prompt = tokenizer.encode("def main():")
    want = model.generate(torch.tensor([prompt]), 6, temperature=0)[0, len(prompt):].tolist()
    assert cli.main(["generate", str(run_dir), "--prompt", "def main():", "--tokens", "6",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(want) + "\n"
