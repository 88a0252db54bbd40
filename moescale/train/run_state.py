"""A run's checkpoint: the dense half on rank 0, the experts sharded by the ranks that hold them.

A checkpoint of step s is
- `checkpoints/expert-shards-<s>/rank<r>/`: each rank that holds experts writes its own
  (moescale.expert_state.save_expert_shards: fp32 masters and AdamW moments keyed by layer and
  GLOBAL expert id, checksummed; disk-tier records hard-linked, not copied). Nothing is
  gathered: no process holds more than its own experts while saving or loading. Data-parallel
  replicas of the experts are written by one replica; a node-shared store (dynamic placement)
  by node 0's ranks, each its block (`share`);
- `checkpoints/ckpt_<s>.safetensors`, written by rank 0 once every rank's shard is in place
  (the commit point): the dense parameters and buffers (`model.<name>`, expert state left
  out), the dense AdamW state keyed by parameter *name* (`optim.<name>.<key>`; names do not
  change with the layout, indices do), the RNG, and in its JSON state the optimizer's
  hyper-parameters and every writer rank's shard entry (`expert_shards`).

Resume at any rank count, exchange or residency: the dense half loads into every rank (its
expert keys left out), the dense optimizer state by name, then each rank reads only the experts
it now holds from whichever shards have them, verifying every checksum before anything changes;
a damaged or missing shard raises StoreCheckpointError, and the trainer falls back to the
previous checkpoint. A checkpoint written before this format (one consolidated file,
`optim.<index>.` keys) loads through legacy_state.py.

Expert shards of checkpoints no longer kept are removed with them (`after_save`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from moescale.expert_state import (SHARDS_PREFIX, expert_parameters, expert_state_keys,
                                   load_expert_shards, save_expert_shards, shards_dir)
from moescale.models.resident import dense_state_dict
from moescale.parallel.dense_shard import full_dense, is_sharded, shard_like
from moescale.layers.moe import MoE
from moescale.train.checkpoint import list_checkpoints, nonfinite, optimizer_from_flat
from moescale.train.legacy_state import LegacyState


FORMAT = 2      # state["format"]: the dense half + expert shards


class RunState:
    """The checkpoint of a run (see the module docstring)."""

    def __init__(self, exchange, residency, ranks, model) -> None:
        self.exchange, self.residency, self.ranks = exchange, residency, ranks
        # who writes which experts: the residency's word (parts.py: Residency.shard_role)
        self.writes_experts, self.share = residency.shard_role(exchange)
        self.legacy = LegacyState(exchange, residency, ranks, model, node_shared=self.share
                                  is not None)
        self.model = self.optimizer = None

    def attach(self, model, optimizer) -> None:
        """Called once the model is prepared and the dense optimizer built."""
        self.model, self.optimizer = model, optimizer
        self.legacy.attach(model, optimizer)

    # -- save ----------------------------------------------------------------------------
    def _names(self) -> tuple[dict[int, str], set[int]]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return names, {id(p) for p in expert_parameters(self.model)}

    def dense_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors: `model.<name>` and `optim.<name>.<key>` of the dense half, the
        optimizer's JSON-able rest: its groups' hyper-parameters and parameter names)."""
        skip = expert_state_keys(self.model)
        tensors = {f"model.{k}": full_dense(v) for k, v in dense_state_dict(self.model).items()
                   if k not in skip}     # full_dense: a sharded dense half saved whole (collective)
        names, experts = self._names()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        sd = self.optimizer.state_dict()
        scalars = {}
        for pid, state in sd["state"].items():
            p = params[pid]
            if id(p) in experts:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{names[id(p)]}.{key}"] = full_dense(value)
                else:
                    scalars[f"{names[id(p)]}.{key}"] = value
        groups = []
        for g_sd, g in zip(sd["param_groups"], self.optimizer.param_groups):
            hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g_sd.items()
                     if k != "params"}
            groups.append(dict(hyper, params=[names[id(p)] for p in g["params"]
                                              if id(p) not in experts]))
        return tensors, {"param_groups": groups, "scalars": scalars}

    def nonfinite_experts(self) -> tuple[str, int] | None:
        """A resident expert tensor holding NaN or Inf (never written), else None."""
        names, _ = self._names()
        return nonfinite({names[id(p)]: p.detach() for p in expert_parameters(self.model)})

    def _dense(self) -> bool:
        """A model with no MoE layer (model.moe_every 0): its checkpoints have no shards."""
        return not any(isinstance(m, MoE) for m in self.model.modules())

    def save_experts(self, ckpt_dir: Path, step: int) -> dict | None:
        """This rank's expert shard (None: another replica writes these experts, or there
        are none)."""
        if not self.writes_experts or self._dense():
            return None
        return save_expert_shards(self.model, str(ckpt_dir), rank=self.ranks.rank,
                                  tag=f"{step:08d}", optimizer=self.optimizer,
                                  engine=self.residency.engine, share=self.share)

    def after_save(self, ckpt_dir: Path) -> None:
        """Remove the expert shards (and older formats' stores) of checkpoints not kept."""
        kept = {f"{step:08d}" for step, _ in list_checkpoints(ckpt_dir)}
        keep = {shards_dir(tag) for tag in kept} | {f"store_{tag}" for tag in kept}
        for entry in ckpt_dir.iterdir():
            ours = entry.name.startswith(("store_", SHARDS_PREFIX))
            if ours and entry.name not in keep and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------
    def load(self, ckpt_dir: Path, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Restore model, optimizer and experts from a verified checkpoint (any layout)."""
        if state.get("format") != FORMAT:
            return self._load_legacy(ckpt_dir, tensors, state)
        skip = expert_state_keys(self.model)
        dense = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        if is_sharded(self.model):     # parallel.dense shard: each rank cuts its pieces
            own = dense_state_dict(self.model)
            dense = {k: shard_like(v, own.get(k)) for k, v in dense.items()}
        missing, unexpected = self.model.load_state_dict(dense, strict=False)
        missing = [k for k in missing if k not in skip]
        if missing or unexpected:
            raise KeyError(f"the dense state does not fit this model (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
        self._load_dense_optimizer(tensors, state["optimizer"])
        if self._dense():
            return
        load_expert_shards(self.model, str(ckpt_dir), state.get("expert_shards") or [],
                           optimizer=self.optimizer, engine=self.residency.engine,
                           share=self.share)
        if self.share is not None:
            self.ranks.barrier()       # a shared store is whole before anyone reads it

    def _load_dense_optimizer(self, tensors, rest: dict) -> None:
        names, _ = self._names()
        groups = self.optimizer.param_groups
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
            g = {k: (tuple(v) if k == "betas" else v) for k, v in saved.items()
                 if k != "params"}
            g["foreach"] = group.get("foreach")    # this optimizer's kernels (optim.py), not state
            loaded_groups.append(dict(g, params=ids))
        opt_state: dict[int, dict] = {}
        params = dict(self.model.named_parameters())
        for name, value in tensors.items():
            if name.startswith("optim."):
                pname, key = name[len("optim."):].rsplit(".", 1)
                like = params[pname] if value.shape == params[pname].shape else None
                opt_state.setdefault(pid[pname], {})[key] = shard_like(value, like)
        for name, value in rest["scalars"].items():
            pname, key = name.rsplit(".", 1)
            opt_state.setdefault(pid[pname], {})[key] = value
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": loaded_groups})

    def _load_legacy(self, ckpt_dir: Path, tensors, state: dict) -> None:
        legacy = self.legacy
        model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        legacy.load_model_state(self.model, model_sd)
        optimizer_from_flat(self.optimizer, legacy.local_optimizer_tensors(tensors),
                            legacy.local_optimizer_groups(state["optimizer"]))
        legacy.load_extra(ckpt_dir, state)
