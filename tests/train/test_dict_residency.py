"""A new residency in one file: tests/train/dict_residency.py, handed to the trainer from outside.

`DictResidency` keeps each expert in a dict of plain tensors and steps it with its own AdamW;
no library file knows it. Handed over as a class (`Trainer(..., residency=DictResidency)`) or,
for the ranks of `train_distributed`, as the string "<this folder>/dict_residency.py:
DictResidency" (each rank imports the file; or a pickled factory), it trains every exchange of the set-up matrix
(single process, static EP, pipelined EP with 2 chunks and with chunks/reuse auto, dynamic
placement: 2 gloo ranks) to the losses, validation losses, grad norms and routed counts of
single-process resident training (test_setup_matrix's reference), writes expert shards that
hold each expert once and a dense half equal to the reference's, resumes the step-10 checkpoint
at the other rank count with the same residency to the same losses, and its end-of-run
Hugging Face export loads in transformers with `load_run`'s logits.

Dynamic placement needs no PLACED capability here: the dispatcher's replicated path
(`forward_rows` on every rank's full copy) serves it, and `DictStep` sums the partial
gradients over the node's ranks (as `parallel.dynamic.sum_expert_grads` does for parameters).

The fast tests check how `residency=` is resolved and refused (train/residency.py:
custom_residency).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from moescale.train.residency import Resident, custom_residency
from moescale.train.trainer import Trainer
from moescale.train.config import load_config
from test_setup_matrix import EXCHANGES, STEPS, _config, _train, reference  # noqa: F401
from train_helpers import TINY, assert_same_run, resume_copy, run_records

HERE = Path(__file__).resolve().parent
SPEC = f"{HERE / 'dict_residency.py'}:DictResidency"


def _train_dict(config, run_dir, ranks: int, resume: bool = False, residency=SPEC) -> dict:
    """`config` trained with DictResidency (on several ranks handed over as `residency`);
    returns rank 0's summary."""
    if ranks > 1:
        from moescale.train.launch import train_distributed

        code, summary = train_distributed(config, run_dir, ranks, resume=resume, quiet=True,
                                          deadline_s=150, residency=residency)
    else:
        from dict_residency import DictResidency

        trainer = Trainer(config, run_dir, resume=resume, out=open("/dev/null", "w"),
                          err=open("/dev/null", "w"), residency=DictResidency)
        code, summary = trainer.run(), trainer.summary
    assert code == 0 and summary["world_size"] == ranks and summary["step"] == STEPS
    return summary


def _check_shards(run_dir, ref_dir, ranks: int) -> None:
    """Each expert in exactly one shard; the dense half is the reference's."""
    import torch

    from moescale.train.checkpoint import checkpoint_path, load_checkpoint

    tensors, state = load_checkpoint(checkpoint_path(run_dir / "checkpoints", STEPS))
    want, want_state = load_checkpoint(checkpoint_path(ref_dir / "checkpoints", STEPS))
    assert tensors.keys() == want.keys() and state["optimizer"] == want_state["optimizer"]
    for key, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(tensors[key], value, rtol=1e-3, atol=1e-5, msg=key)
    shards = state["expert_shards"]
    assert shards and all(s["rank"] < ranks for s in shards)
    for layer in shards[0]["experts"]:
        held = sorted(e for s in shards for first, stop in s["experts"][layer]
                      for e in range(first, stop))
        assert held == [0, 1, 2, 3], (layer, held)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_the_dict_residency_trains_every_exchange_and_resumes_at_the_other_rank_count(
        corpus, reference, tmp_path, exchange):
    ref_dir, want = reference
    ranks = 1 if exchange == "single" else 2
    run_dir = tmp_path / "run"
    summary = _train_dict(_config(corpus, run_dir, **EXCHANGES[exchange]), run_dir, ranks)
    assert summary["offload_plan"] == "dict" and summary["hf_export"] == str(run_dir / "hf")
    got = run_records(run_dir)
    assert_same_run(got, want)
    for a, b in zip(got, want):           # DictStep's global norm: dense and experts
        if "grad_norm" in b:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
    _check_shards(run_dir, ref_dir, ranks)
    again = resume_copy(run_dir, tmp_path / "again", STEPS // 2)
    other = {"parallel.ep_size": "2"} if exchange == "single" else {}
    # the 2-rank resume gets a pickled factory instead of the string
    _train_dict(_config(corpus, again, **other), again, 3 - ranks, resume=True,
                residency=functools.partial(custom_residency, SPEC))
    got = [r for r in run_records(again) if r["step"] > STEPS // 2]
    assert_same_run(got, want, first_step=STEPS // 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dict_residency_run_exports_to_hugging_face_with_its_logits(corpus, tmp_path):
    """RUN_DIR/hf of a 2-rank expert-parallel run loads in transformers with load_run's
    logits (the experts come from DictResidency's shards)."""
    from test_export_run import check_export

    run_dir = tmp_path / "run"
    _train_dict(_config(corpus, run_dir, **EXCHANGES["static-ep"]), run_dir, 2)
    check_export(run_dir / "hf", run_dir, remote=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resident_experts_handed_to_dynamic_placement_are_refused_in_one_line(corpus, tmp_path):
    """The library's Resident would average the placement's partial gradients (summed by
    DictStep, the shared store or sum_expert_grads): refused, not trained wrong."""
    from moescale.train.launch import train_distributed

    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, **EXCHANGES["dynamic"])
    with pytest.raises(RuntimeError) as err:
        train_distributed(config, run_dir, 2, quiet=True, deadline_s=60,
                          residency="moescale.train.residency:Resident")
    assert "ValueError: resident experts with every expert on each of the 2 ranks that place " \
           "them (dynamic placement)" in str(err.value)


def test_residency_is_taken_as_an_object_a_factory_or_a_module_or_file_name():
    config = load_config(None, dict(TINY))
    resident = Resident()
    assert custom_residency(resident, config) is resident
    assert isinstance(custom_residency(lambda c: Resident(), config), Resident)
    assert isinstance(custom_residency("moescale.train.residency:Resident", config), Resident)
    made = custom_residency(SPEC, config)
    assert type(made).__name__ == "DictResidency" and not made.replicated
    dynamic = load_config(None, dict(TINY, **{"parallel.placement": "dynamic"}))
    assert custom_residency(lambda c: custom_residency(SPEC, c), dynamic).replicated
    by_module = custom_residency("dict_residency:DictResidency", config)   # a class: a factory
    assert type(by_module).__name__ == "DictResidency"


@pytest.mark.parametrize("spec, words", [
    ("dict_residency.DictResidency", "must be 'package.module:name'"),
    ("no_such_module_here:Thing", "cannot import 'no_such_module_here'"),
    (f"{HERE / 'missing.py'}:Thing", "cannot import"),
    (f"{SPEC}x", "has no 'DictResidencyx'"),
    ("moescale.train.residency:PRECISION_DTYPES", "is not a moescale.train.parts.Residency"),
    (object(), "gave a object, which is not"),
])
def test_a_residency_that_cannot_be_used_is_refused_in_one_line(spec, words):
    with pytest.raises(ValueError) as err:
        custom_residency(spec, load_config(None, dict(TINY)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_residency_of_ones_own_refuses_an_offload_tier():
    config = load_config(None, dict(TINY, **{"offload.mode": "host"}))
    with pytest.raises(ValueError, match="leave offload.tier device-only"):
        custom_residency(SPEC, config)


@pytest.mark.parametrize("glu", ["false", "true"])
def test_a_live_dict_residency_model_gives_its_experts_to_export_and_back(glu):
    """consolidated_state_dict (what export_hf and export_mixtral read) and resident_model
    find DictExperts' tensors through STATE_ACCESS: the model's own state, unchanged logits."""
    import torch

    from dict_residency import DictResidency
    from moescale.models import consolidated_state_dict, resident_model
    from moescale.train.exchange import LocalExchange
    from moescale.train.model import build_model

    config = load_config(None, dict(TINY, **{"model.glu": glu}))
    torch.manual_seed(0)
    model = build_model(config, 256)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    idx_BS = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits = model(idx_BS)[0]
    DictResidency(config).prepare(model, LocalExchange())
    assert not any("experts." in k for k in model.state_dict())     # not in the module tree
    got = consolidated_state_dict(model)
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(model(idx_BS)[0], logits, rtol=1e-5, atol=1e-6)
        resident_model(model)
        torch.testing.assert_close(model(idx_BS)[0], logits, rtol=1e-5, atol=1e-6)
    assert any("experts.w1_EDF" in k for k in model.state_dict())
