"""The dense half of a run's state as flat tensors keyed by name, for any layout of the model.

    tensors, rest = dense_state(model, optimizer, skip)    # model.<name>, optim.<name>.<key>
    local = local_tensors(tensors)                          # this rank's shards
    load_dense_state(model, optimizer, tensors, rest, skip) # back, from a verified checkpoint
    targets = load_targets(model, optimizer, shapes, skip)  # where DCP reads a checkpoint into

The model half comes from torch.distributed.checkpoint.state_dict's `get_model_state_dict`
(plain tensors for a replicated or one-process model, DTensors for one sharded with FSDP2's
`fully_shard`) and goes back through `set_model_state_dict`. The optimizer's per-parameter
tensors are keyed by parameter *name* (`optim.<name>.<key>`: names do not change with the
layout, indices do) with their own type (a sharded parameter's moments are DTensors too);
the JSON-able rest (each group's hyper-parameters and parameter names, non-tensor state) goes
into the commit point's JSON. `skip` (moescale.expert_state.expert_state_keys) leaves out the
experts, which the expert shards hold.

Why not get_state_dict's optimizer half: it initialises an empty optimizer by stepping it once
with zero gradients (AdamW's step counter becomes 1, which changes the bias correction of every
later step, so a run that saves its initial state would train differently from one that does
not), and it gives the parameters a checkpoint leaves out (the experts) empty state on load.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

from moescale.models.resident import OffloadedExpertsWarning, dense_state_dict
from moescale.parallel.dense_shard import is_sharded, shard_like


def _model_state(model) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():     # offloaded experts are not in it: the shards hold them
        warnings.simplefilter("ignore", OffloadedExpertsWarning)
        return get_model_state_dict(model)


def local_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of each tensor (a DTensor's local shard), for checks that must not
    start a collective on one rank only (finiteness)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def _param_names(model) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def dense_state(model, optimizer, skip: set[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors: `model.<name>` and `optim.<name>.<key>` of the dense half, the optimizer's
    JSON-able rest: its groups' hyper-parameters and parameter names, non-tensor state)."""
    tensors = {f"model.{k}": v for k, v in _model_state(model).items() if k not in skip}
    names = _param_names(model)
    dense = {id(p) for n, p in model.named_parameters() if n not in skip}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    scalars = {}
    for pid, state in sd["state"].items():
        p = params[pid]
        if id(p) not in dense:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{names[id(p)]}.{key}"] = value
            else:
                scalars[f"{names[id(p)]}.{key}"] = value
    groups = []
    for g_sd, g in zip(sd["param_groups"], optimizer.param_groups):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g_sd.items()
                 if k != "params"}
        groups.append(dict(hyper, params=[names[id(p)] for p in g["params"] if id(p) in dense]))
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_targets(model, optimizer, shapes: dict[str, tuple], skip: set[str]
                 ) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `shapes` ({name: (global shape, dtype)}) is read into: the
    model's own state (read in place) and new optimizer tensors laid out like their parameter
    (a DTensor's shards for a sharded one). KeyError when the checkpoint does not fit."""
    model_sd = {f"model.{k}": v for k, v in _model_state(model).items() if k not in skip}
    saved = {k for k in shapes if k.startswith("model.")}
    missing, unexpected = sorted(set(model_sd) - saved), sorted(saved - set(model_sd))
    wrong = sorted(k for k in set(model_sd) & saved if tuple(model_sd[k].shape) !=
                   tuple(shapes[k][0]))
    if missing or unexpected or wrong:
        raise KeyError(f"the dense state does not fit this model (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}, other shapes {wrong[:3]})")
    params = dict(model.named_parameters())
    targets = dict(model_sd)
    for key, (shape, dtype) in shapes.items():
        if not key.startswith("optim."):
            continue
        pname = key[len("optim."):].rsplit(".", 1)[0]
        if pname not in params:
            raise KeyError(f"the checkpoint's optimizer steps {pname!r}, which this model "
                           "does not have")
        p = params[pname].detach()
        targets[key] = torch.zeros_like(p, dtype=dtype) if tuple(shape) == tuple(p.shape) \
            else torch.zeros(shape, dtype=dtype)
    return targets


def load_dense_state(model, optimizer, tensors: dict[str, torch.Tensor], rest: dict,
                     skip: set[str], whole: bool = False) -> None:
    """Set the model's dense half (`model.<name>`) and the dense optimizer state
    (`optim.<name>.<key>`, `rest`) from a verified checkpoint: through set_model_state_dict,
    or with `whole` (a format-2 checkpoint's whole tensors) model.load_state_dict as then."""
    dense = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if whole and is_sharded(model):    # parallel.dense shard: each rank cuts its pieces
        own = dense_state_dict(model)
        dense = {k: shard_like(v, own.get(k)) for k, v in dense.items()}
    missing, unexpected = model.load_state_dict(dense, strict=False) if whole else \
        set_model_state_dict(model, dense, options=StateDictOptions(strict=False))
    missing = [k for k in missing if k not in skip]
    if missing or unexpected:
        raise KeyError(f"the dense state does not fit this model (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]})")
    load_named_optimizer(model, optimizer, tensors, rest)


def load_named_optimizer(model, optimizer, tensors: dict[str, torch.Tensor], rest: dict) -> None:
    """The dense optimizer state from `optim.<name>.<key>` tensors and the JSON rest (the
    parameters left out, the experts, get theirs from the expert shards afterwards)."""
    names = _param_names(model)
    groups = optimizer.param_groups
    if len(rest["param_groups"]) != len(groups):
        raise ValueError(f"the checkpoint's optimizer has {len(rest['param_groups'])} "
                         f"parameter groups, this one {len(groups)}")
    pid = {}
    loaded_groups = []
    for saved, group in zip(rest["param_groups"], groups):
        mine = [names[id(p)] for p in group["params"]]
        absent = set(saved["params"]) - set(mine)
        if absent:
            raise ValueError(f"the checkpoint's optimizer steps {sorted(absent)[:3]}, which "
                             "this model's optimizer group does not hold")
        ids = list(range(len(pid), len(pid) + len(mine)))
        pid.update(zip(mine, ids))
        g = {k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"}
        g["foreach"] = group.get("foreach")    # this optimizer's kernels (optim.py), not state:
        # torch's foreach kernels cannot step sharded and plain tensors in one call
        loaded_groups.append(dict(g, params=ids))
    opt_state: dict[int, dict] = {}
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        if name.startswith("optim."):
            pname, key = name[len("optim."):].rsplit(".", 1)
            like = params[pname] if value.shape == params[pname].shape else None
            opt_state.setdefault(pid[pname], {})[key] = shard_like(value, like)  # a whole
            # tensor (format 2) into a sharded run; a DTensor or plain one as it is
    for name, value in rest["scalars"].items():
        pname, key = name.rsplit(".", 1)
        opt_state.setdefault(pid[pname], {})[key] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": loaded_groups})
