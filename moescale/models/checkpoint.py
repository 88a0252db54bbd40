"""The consolidated model checkpoint: one safetensors file, no pickle, independent of rank count.

FastMoE's users cannot merge per-rank checkpoints; here every expert tensor is saved stacked over
ALL experts of its layer, so a checkpoint written by 1, 2 or 8 expert-parallel ranks is the same
file, and any layout can load it.

The format (version 1):
- tensors: the model's state dict. Expert tensors use the names and layout of
  `moescale.layers.experts.GroupedExperts`: `<moe>.experts.w1_EDF` [E, D, F],
  `<moe>.experts.w2_EFD` [E, F, D], `<moe>.experts.w3_EDF` [E, D, F] (GLU), `<moe>.experts.b1_EF`,
  `<moe>.experts.b2_ED`, with E the layer's GLOBAL expert count and row e the global expert e.
  Any other component that holds experts (expert-parallel shards, offloaded stores) presents
  them under these names when saving: `merge_expert_shards` assembles per-rank slices and
  `slice_experts` cuts the rows a rank owns when loading. `ModuleExperts` keep their own
  per-expert names (`<moe>.experts.experts.<e>.<param>`).
- experts kept outside the module tree: `consolidated_state_dict(model)` reads containers that
  declare STATE_ACCESS and hold no parameter (offloaded by `offload_moe`, node stores, another
  residency's tensors: `resident.is_offloaded`) through their `state_access`
  (moescale.layers.state_access: fp32 master copies), under the names above. Loading goes into a model before it is offloaded (build,
  `load_checkpoint`, then `offload_moe`). Dtypes are kept (fp32 masters stay fp32). Tensors
  that share storage (tied embeddings) are written once.
- header metadata (safetensors' str -> str map): `format` = "moescale-consolidated",
  `version` = "1", `expert_keys` (JSON list of the keys whose dim 0 is the expert index),
  `aliases` (JSON {alias: stored key} for shared tensors) and `user` (JSON of the caller's
  metadata, e.g. the model config and step).

Writes are atomic: a temp file in the same directory, fsync, os.replace, fsync of the directory.

Deliberately not here: optimizer state, RNG state, data-loader position and run directories
(the trainer's checkpoints own those and may store this file inside one); Hugging Face export
(see hf.py); collective communication (callers gather shards; these are pure functions).

Legend: E experts (global), D model width, F expert hidden width.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from moescale.atomic import atomic_path
from moescale.models.resident import dense_state_dict, expert_masters, is_offloaded

FORMAT_NAME = "moescale-consolidated"
FORMAT_VERSION = "1"
EXPERT_SUFFIXES = (".w1_EDF", ".w2_EFD", ".w3_EDF", ".b1_EF", ".b2_ED")


def expert_keys(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> list[str]:
    """Keys of stacked expert tensors (dim 0 = expert): GroupedExperts' parameter names."""
    keys = model_or_state.state_dict().keys() if isinstance(model_or_state, nn.Module) \
        else model_or_state.keys()
    return [k for k in keys if k.endswith(EXPERT_SUFFIXES)]


def _external_experts(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The experts a container keeps outside its parameters (names relative to it), or None."""
    if not is_offloaded(module):
        return None
    per_expert = expert_masters(module)
    if module.state_access("experts").stacked:     # stacked FFN experts: the same names
        return {name: torch.stack([p[name] for p in per_expert]) for name in per_expert[0]}
    return {f"experts.{e}.{name}": t for e, p in enumerate(per_expert) for name, t in p.items()}


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every expert present, in the consolidated layout."""
    state = dict(dense_state_dict(model))
    for path, module in model.named_modules():
        extra = _external_experts(module)
        if extra:
            prefix = f"{path}." if path else ""
            state.update({prefix + name: t for name, t in extra.items()})
    return state


def _dedupe(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each shared tensor once; aliases map the other names to the stored one."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"state[{key!r}] is a {type(tensor).__name__}; a checkpoint holds "
                             "tensors only (put other values in metadata=)")
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                 tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype) \
            if tensor.device.type != "meta" and tensor.numel() else None
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        stored[key] = tensor.detach().to("cpu").contiguous()
    return stored, aliases


def save_checkpoint(path: str | os.PathLike, model_or_state: nn.Module | Mapping[str, torch.Tensor],
                    *, metadata: Mapping[str, Any] | None = None) -> None:
    """Write the consolidated checkpoint of a model (or a full state dict) to `path` atomically.

    metadata: JSON-serialisable values stored in the header (e.g. {"config": asdict(cfg)}).
    """
    from safetensors.torch import save_file

    state = consolidated_state_dict(model_or_state) if isinstance(model_or_state, nn.Module) \
        else dict(model_or_state)
    stored, aliases = _dedupe(state)
    try:
        user = json.dumps(dict(metadata or {}), sort_keys=True)
    except TypeError as err:
        raise ValueError(f"metadata must be JSON-serialisable ({err}); convert dataclasses "
                         "with dataclasses.asdict and tensors with .tolist()") from None
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
              "expert_keys": json.dumps(expert_keys(state)), "aliases": json.dumps(aliases),
              "user": user}
    with atomic_path(path) as tmp:
        save_file(stored, str(tmp), metadata=header)


def check_format(where: str | os.PathLike, what: str, field: tuple[str, str], found,
                 version: int | str, found_version) -> None:
    """Refuse a saved file that is not `what` (its `field` = (name, expected value) reads
    `found`) or is of another format version; either way transformers' own checkpoints are
    pointed to from_pretrained. Shared by the consolidated checkpoint and save_moefied."""
    name, expected = field
    if found != expected:
        raise ValueError(f"{str(where)!r} is not {what} ({name}={found!r}); Hugging Face "
                         "checkpoints load with transformers' from_pretrained")
    if found_version != version:
        raise ValueError(f"{str(where)!r} has format version {found_version!r}; this moescale "
                         f"reads version {version}")


def read_checkpoint(path: str | os.PathLike, *, device: str | torch.device = "cpu"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with aliases restored, user metadata) of a consolidated checkpoint."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist; give the path of a "
                         ".safetensors file written by save_checkpoint")
    with safe_open(path, framework="pt", device=str(device)) as f:
        header = f.metadata() or {}
        check_format(path, "a moescale consolidated checkpoint", ("format", FORMAT_NAME),
                     header.get("format"), FORMAT_VERSION, header.get("version"))
        state = {key: f.get_tensor(key) for key in f.keys()}
    for alias, key in json.loads(header.get("aliases", "{}")).items():
        state[alias] = state[key]
    return state, json.loads(header.get("user", "{}"))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, *, strict: bool = True,
                    expert_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Load a consolidated checkpoint into `model`; returns the user metadata.

    expert_ids: the global experts this model's expert tensors hold (a rank's shard under
    expert parallelism), in row order; None means all of them.
    """
    if any(is_offloaded(m) for m in model.modules()):
        raise ValueError("this model's experts live outside it (offloaded); load the checkpoint "
                         "into the model before offload_moe(model), then offload it")
    state, user = read_checkpoint(path)
    if expert_ids is not None:
        state = slice_experts(state, expert_ids)
    own = dense_state_dict(model)
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and own[k].shape != v.shape]
    if mismatched:
        raise ValueError("checkpoint shapes differ from the model's (build the model with the "
                         "config saved in the checkpoint's metadata, or pass expert_ids for "
                         "an expert shard): " + "; ".join(mismatched[:5]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint and model disagree: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}; pass strict=False to load the common part")
    return user


def slice_experts(state: Mapping[str, torch.Tensor], expert_ids: Sequence[int]
                  ) -> dict[str, torch.Tensor]:
    """A copy of `state` whose expert tensors keep only the rows `expert_ids` (in that order)."""
    ids = list(expert_ids)
    out = dict(state)
    for key in expert_keys(state):
        num_experts = state[key].shape[0]
        bad = [e for e in ids if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"expert_ids {bad} are out of range for {key} with {num_experts} "
                             "experts")
        out[key] = state[key][torch.tensor(ids, dtype=torch.long)]
    return out


def merge_expert_shards(shards: Sequence[Mapping[str, torch.Tensor]],
                        expert_ids: Sequence[Iterable[int]]) -> dict[str, torch.Tensor]:
    """One consolidated state dict from per-rank state dicts.

    shards[r] holds rank r's state dict; its expert tensors hold the global experts
    `expert_ids[r]` in row order. Every global expert must appear exactly once; other tensors
    are taken from shard 0 (replicated parameters are equal on every rank).
    """
    if not shards or len(shards) != len(expert_ids):
        raise ValueError(f"got {len(shards)} shards and {len(expert_ids)} expert id lists; give "
                         "one list of global expert ids per shard")
    ids = [list(x) for x in expert_ids]
    flat = sorted(e for group in ids for e in group)
    if flat != list(range(len(flat))):
        raise ValueError(f"expert ids {flat} must cover 0..E-1 exactly once across shards")
    out = dict(shards[0])
    for key in expert_keys(shards[0]):
        first = shards[0][key]
        merged = first.new_empty((len(flat),) + tuple(first.shape[1:]))
        for shard, group in zip(shards, ids):
            if key not in shard or shard[key].shape[0] != len(group):
                raise ValueError(f"shard holding experts {group} lacks {key} or has "
                                 f"{shard[key].shape[0] if key in shard else 0} rows for it")
            merged[torch.tensor(group, dtype=torch.long)] = shard[key]
        out[key] = merged
    return out
