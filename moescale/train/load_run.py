"""`moescale.load_run(RUN_DIR)`: the trained model of a `moescale train` run, in one process.

    model, config = moescale.load_run("runs/20261201-223000")          # newest checkpoint
    model, config = moescale.load_run(run_dir, step=250, device="cuda")

The run's `config.toml` rebuilds the GPT (the size, the overrides the run resolved, the
vocabulary from the checkpoint's embedding; a `--model.hf` run's shape from model.hf's
config.json, or the run's copy of it, hf_config.json); the weights come from the newest checkpoint that
verifies (or checkpoint `step`): its dense half (a DCP directory written by any number of
ranks, sharded or replicated, read whole here: dense_dcp.consolidated), then every expert from
the per-rank expert shards (moescale.expert_state), whichever exchange and residency wrote
them: one process or expert-parallel ranks, resident or offloaded (host tier, disk-tier
records), dynamic placement's node store. The result is a plain, single-process, resident
GPT in eval mode on `device`; optimizer state is not read. Checkpoints of earlier formats load
too (format 2: the dense half whole in the commit file; the consolidated one: every tensor in
it). A checkpoint that fails verification (commit file, dense directory or expert shard) is
reported on stderr and the previous one is used, as `--resume` does; with `step` given it is
an error.

The model is built on the meta device and filled from the checkpoint, so nothing is
initialised twice and no expert exists twice in memory. `load_run_offloaded` (used by
moescale.train.streamed for generation past memory) builds it offloaded instead: its experts go
into an ExpertStore (`offload_moe`) that the checkpoint's expert shards fill (disk-tier records
on the same filesystem by hard link: no expert passes through memory), so only the dense half
is ever resident.

`run_tokenizer(config, run_dir)` is the run's text codec: `data.tokenizer` when the run recorded
one (or the run's copy of it, RUN_DIR/tokenizer/, once the original is gone;
moescale.train.tokenizer), else None (byte-level ids).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from moescale.expert_state import expert_state_keys, load_expert_shards
from moescale.layers.moe import MoE
from moescale.models import GPT
from moescale.offload.checkpoint import StoreCheckpointError
from moescale.train.checkpoint import (CheckpointError, checkpoint_path, list_checkpoints,
                                       load_checkpoint, verified_checkpoints)
from moescale.train.config import RunConfig, load_config, saved_tree
from moescale.train.dense_dcp import consolidated, verify_dense
from moescale.train.run_state import FORMAT as RUN_STATE_FORMAT, SHARDED_FORMATS
from moescale.train.model import build_model


def run_config(run_dir: str | Path) -> RunConfig:
    """The RunConfig in RUN_DIR/config.toml, or ValueError saying what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist; give the directory a "
                         "`moescale train` run wrote (runs/<timestamp>)")
    return load_config(None, None, base=saved_tree(run_dir, f"run directory {str(run_dir)!r}"))


def _with_dense(ckpt_dir: Path, tensors: dict[str, torch.Tensor], state: dict
                ) -> dict[str, torch.Tensor]:
    """The commit file's tensors plus, for a checkpoint whose dense half is a DCP directory
    (dense_dcp.py, written by any number of ranks, sharded or not), that half's weights
    whole, verified first (CheckpointError naming a bad file)."""
    if state.get("format") != RUN_STATE_FORMAT:
        return tensors
    verify_dense(ckpt_dir, state.get("dense"))
    return dict(tensors, **consolidated(ckpt_dir, state["dense"], prefix="model."))


def _build(config: RunConfig, tensors: dict[str, torch.Tensor], device, run_dir,
           offload=None) -> tuple[GPT, object]:
    """(the model on `device`, its OffloadEngine or None); `offload(model) -> engine` offloads
    the meta-device model's experts before the dense half is allocated."""
    vocab_size = tensors["model.tok_emb.weight"].shape[0]
    with torch.device("meta"):      # model.hf: its config.json, or the run's copy of it
        model = build_model(config, vocab_size, run_dir=run_dir)
    engine = offload(model) if offload is not None else None
    model.to_empty(device=device)
    if model.config.tie_embeddings:          # to_empty gives each name its own tensor
        model.lm_head.weight = model.tok_emb.weight
    return model, engine


def _fill(model: GPT, ckpt_dir: Path, tensors: dict[str, torch.Tensor], state: dict,
          engine=None) -> None:
    """Dense half, then the expert shards (any writer layout); legacy: everything dense."""
    dense = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    sharded = state.get("format") in SHARDED_FORMATS
    missing, unexpected = model.load_state_dict(dense, strict=False)
    if sharded:
        missing = sorted(set(missing) - expert_state_keys(model))
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit the model its config.toml builds "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if engine is not None and not sharded:
        raise ValueError("this run's checkpoints are of the earlier consolidated format (every "
                         "expert in the dense file); load it resident (moescale.load_run), or "
                         "train on to write a checkpoint of the current format")
    if sharded and any(isinstance(m, MoE) for m in model.modules()):   # moe_every 0: dense
        load_expert_shards(model, str(ckpt_dir), state.get("expert_shards") or [],
                           engine=engine, masters_only=engine is not None)


def load_run(run_dir: str | Path, step: int | None = None, device: str | torch.device = "cpu"
             ) -> tuple[GPT, RunConfig]:
    """(model in eval mode on `device`, the run's RunConfig); see the module docstring."""
    model, config, _ = load_run_offloaded(run_dir, step, device, None)
    return model, config


def load_run_offloaded(run_dir: str | Path, step: int | None, device: str | torch.device,
                       offload) -> tuple[GPT, RunConfig, object]:
    """load_run whose experts `offload(model) -> OffloadEngine` moves out of the meta-device
    model first (None: resident); returns (model, config, engine or None). The offloaded
    experts are for generation: only their masters are read and verified (the moments load as
    zero). The engine of a checkpoint that fails verification is closed before the previous
    one is tried."""
    config = run_config(run_dir)
    ckpt_dir = Path(run_dir) / "checkpoints"
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise ValueError(f"{str(run_dir)!r} holds no checkpoint (checkpoints/ckpt_*.safetensors); "
                         "the run saved none yet: train it further, or wait for its first "
                         "checkpoint (train.checkpoint_interval)")
    device = torch.device(device)
    if step is not None:
        if step not in {s for s, _ in found}:
            raise ValueError(f"step={step}: {str(run_dir)!r} has checkpoints of steps "
                             f"{[s for s, _ in found]}; pick one of them")
        tensors, state = load_checkpoint(checkpoint_path(ckpt_dir, step))
        tensors = _with_dense(ckpt_dir, tensors, state)
        model, engine = _build(config, tensors, device, run_dir, offload)
        try:
            _fill(model, ckpt_dir, tensors, state, engine)
        except BaseException:
            if engine is not None:
                engine.close()
            raise
        return model.eval(), config, engine
    warn = lambda m: print(m, file=sys.stderr)   # noqa: E731
    for path, tensors, state in verified_checkpoints(ckpt_dir, warn):
        try:
            tensors = _with_dense(ckpt_dir, tensors, state)
        except CheckpointError as err:
            warn(f"warning: {str(err).splitlines()[0]}; trying the previous checkpoint")
            continue
        model, engine = _build(config, tensors, device, run_dir, offload)
        try:
            _fill(model, ckpt_dir, tensors, state, engine)
        except StoreCheckpointError as err:
            warn(f"warning: {str(err).splitlines()[0]}; trying the previous checkpoint")
            if engine is not None:
                engine.close()
            continue
        except BaseException:
            if engine is not None:
                engine.close()
            raise
        return model.eval(), config, engine
    raise ValueError(f"no checkpoint of {str(run_dir)!r} has intact expert shards")


def byte_text(config) -> bool:
    """Whether a run's ids are the bytes of its text: no data.tokenizer and text data, not
    token .bin files (its model's vocabulary may still be larger: model.hf, data.vocab_size)."""
    if config.data.tokenizer:
        return False
    paths = [Path(p.strip()).expanduser() for p in config.data.path.split(",") if p.strip()]
    return not any(p.suffix == ".bin" or (p.is_dir() and next(p.rglob("*.bin"), None))
                   for p in paths)


def run_tokenizer(config: RunConfig, run_dir: str | Path | None = None):
    """The run's tokenizer (`data.tokenizer`, or the run's copy of it in RUN_DIR/tokenizer/
    once the original is gone), or None for byte-level ids."""
    from moescale.train.tokenizer import load_tokenizer, run_tokenizer_path

    path = run_tokenizer_path(getattr(config.data, "tokenizer", "") or "", run_dir)
    return load_tokenizer(path) if path else None
