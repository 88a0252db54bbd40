"""A run's checkpoint: the dense half through DCP, the experts sharded by the ranks that hold them.

A checkpoint of step s is
- `checkpoints/expert-shards-<s>/rank<r>/`: each rank that holds experts writes its own
  (moescale.expert_state.save_expert_shards: fp32 masters and AdamW moments keyed by layer and
  GLOBAL expert id, checksummed; disk-tier records hard-linked, not copied). Nothing is
  gathered: no process holds more than its own experts while saving or loading. Data-parallel
  replicas of the experts are written by one replica; a node-shared store (dynamic placement)
  by node 0's ranks, each its block (`share`);
- `checkpoints/dense-<s>-<id>/`, written by every rank through torch.distributed.checkpoint
  (dense_dcp.py: each tensor once, a sharded one by the ranks that hold its shards; verified,
  then renamed into place): the dense parameters and buffers (`model.<name>`, expert state left
  out) and the dense AdamW state keyed by parameter *name* (`optim.<name>.<key>`; names do not
  change with the layout, indices do): named_state.py;
- `checkpoints/ckpt_<s>.safetensors`, written by rank 0 once both are in place (the commit
  point): the RNG, and in its JSON state the optimizer's hyper-parameters, the dense
  directory's name and its manifest's sha256 (`dense`) and every writer rank's shard entry
  (`expert_shards`).

Resume at any rank count, sharding, exchange or residency: the dense directory is verified
(every file's xxh3-128) and read into whatever layout the model has now (replicated, sharded, one
process), the dense optimizer state by name, then each rank reads only the experts it now holds
from whichever shards have them, verifying every checksum before anything changes; a damaged
or missing file raises CheckpointError or StoreCheckpointError, and the trainer falls back to
the previous checkpoint. Checkpoints of earlier formats load too: format 2 (the same, with the
dense half whole in the commit file) and the consolidated one (one file, `optim.<index>.` keys,
legacy_state.py).

Expert shards and dense directories of checkpoints no longer kept are removed with them
(`after_save`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from moescale.expert_state import (SHARDS_PREFIX, expert_parameters, expert_state_keys,
                                   load_expert_shards, save_expert_shards, shards_dir)
from moescale.layers.moe import MoE
from moescale.train.checkpoint import (NonFiniteError, list_checkpoints, nonfinite,
                                       optimizer_from_flat, remove_unnamed_dense)
from moescale.train.dense_dcp import (dense_metadata, load_dense, save_dense, verify_dense)
from moescale.train.legacy_state import LegacyState
from moescale.train.named_state import (dense_state, load_dense_state, load_targets,
                                        local_tensors)


FORMAT = 3      # state["format"]: the dense half through DCP + expert shards
SHARDED_FORMATS = (2, 3)     # 2: the dense half whole in the commit file (before DCP)


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
    def dense_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors: `model.<name>` and `optim.<name>.<key>` of the dense half, DTensors where
        the dense parameters are sharded; the optimizer's JSON-able rest): named_state.py."""
        return dense_state(self.model, self.optimizer, expert_state_keys(self.model))

    def save_dense(self, tensors: dict[str, torch.Tensor], ckpt_dir: Path, step: int) -> dict:
        """Collective: the dense half's DCP directory (dense_dcp.py); the commit's entry."""
        return save_dense(tensors, ckpt_dir, step, self.ranks)

    def nonfinite_experts(self) -> tuple[str, int] | None:
        """A resident expert tensor holding NaN or Inf (never written), else None."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return nonfinite(local_tensors({names[id(p)]: p.detach()
                                        for p in expert_parameters(self.model)}))

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
        """Remove the expert shards (and older formats' stores) of checkpoints not kept, and
        the dense directories no commit point names."""
        remove_unnamed_dense(ckpt_dir)
        kept = {f"{step:08d}" for step, _ in list_checkpoints(ckpt_dir)}
        keep = {shards_dir(tag) for tag in kept} | {f"store_{tag}" for tag in kept}
        for entry in ckpt_dir.iterdir():
            ours = entry.name.startswith(("store_", SHARDS_PREFIX))
            if ours and entry.name not in keep and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------
    def load(self, ckpt_dir: Path, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Restore model, optimizer and experts from a verified checkpoint (any layout);
        collective. The dense half of format 3 is verified file by file first
        (CheckpointError naming a bad file: the caller falls back)."""
        if state.get("format") not in SHARDED_FORMATS:
            return self._load_legacy(ckpt_dir, tensors, state)
        skip = expert_state_keys(self.model)
        if state["format"] == FORMAT:
            entry = state.get("dense")
            verify_dense(ckpt_dir, entry, self.ranks)
            dense = load_targets(self.model, self.optimizer, dense_metadata(ckpt_dir, entry),
                                 skip)
            load_dense(ckpt_dir, entry, dense)
            found = nonfinite(local_tensors(dense))
            if found is not None:
                raise NonFiniteError(f"dense checkpoint {entry['dir']!r} in {str(ckpt_dir)!r} "
                                     f"holds non-finite values ({found[0]}: {found[1]:,} NaN "
                                     "or Inf, a diverged run's state); it is not used")
            load_dense_state(self.model, self.optimizer, dense, state["optimizer"], skip)
        else:          # format 2: the dense half in the commit file, whole
            load_dense_state(self.model, self.optimizer, tensors, state["optimizer"], skip,
                             whole=True)
        if self._dense():
            return
        load_expert_shards(self.model, str(ckpt_dir), state.get("expert_shards") or [],
                           optimizer=self.optimizer, engine=self.residency.engine,
                           share=self.share)
        if self.share is not None:
            self.ranks.barrier()       # a shared store is whole before anyone reads it

    def _load_legacy(self, ckpt_dir: Path, tensors, state: dict) -> None:
        legacy = self.legacy
        model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        legacy.load_model_state(self.model, model_sd)
        optimizer_from_flat(self.optimizer, legacy.local_optimizer_tensors(tensors),
                            legacy.local_optimizer_groups(state["optimizer"]))
        legacy.load_extra(ckpt_dir, state)
