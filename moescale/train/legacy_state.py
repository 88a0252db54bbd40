"""Resuming from a consolidated checkpoint (the format written before sharded expert checkpoints).

Checkpoints written by moescale before run_state.py's sharded format hold the single-process
state in one file: every expert's weights under `model.`, AdamW state at single-process
parameter indices under `optim.<index>.`, and, for offloaded runs, one store of all experts in
`checkpoints/store_<step>/`. `LegacyState(exchange, residency, ranks, model)` loads such a
checkpoint into any layout, each rank taking its slice (nothing is gathered on load). How they
were written:

- the exchange: a static expert-parallel model's state is consolidated (`full_state_dict`:
  every layer's expert shards gathered into `...experts.w1_EDF` [E, ...]) and its experts' AdamW
  moments (dim 0: local experts) gathered over the EP group, so a checkpoint equals a
  single-process one and resumes at any EP size; dynamic placement reads its shared store
  (dynamic_state.py).
- the residency: an offloaded run writes its store into `checkpoints/store_<step>/` *before*
  the dense checkpoint (the commit point); one process writes it through the store (the disk
  tier hard-links its record files), the ranks of an expert-parallel group gather their stores'
  records to rank 0, which writes them as one store of all E experts (and their masters into
  the model state); on resume each rank loads its experts' slice, so a one-process offloaded run
  and an expert-parallel one resume each other's checkpoints. Stores of checkpoints no longer
  kept are removed.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moescale.offload.checkpoint import StoreCheckpointError
from moescale.offload.experts import OffloadedExpertsBase
from moescale.parallel.expert_parallel import ExpertShard, is_expert_parameter
from moescale.parallel.state import load_full_state_dict
from moescale.train.dynamic_state import DynamicState


class LegacyState:
    """Loads a consolidated checkpoint (see the module docstring)."""

    def __init__(self, exchange, residency, ranks, model, node_shared: bool = False) -> None:
        """node_shared: the residency keeps the experts in one store shared by the node's
        ranks (its shard_role has a share): they load through DynamicState."""
        self.exchange, self.residency, self.ranks = exchange, residency, ranks
        self.dynamic = None
        if node_shared:
            self.dynamic = DynamicState(residency, model)
        self._expert_pids: dict[int, torch.nn.Parameter] = {}

    @property
    def groups(self):
        return self.exchange.groups

    @property
    def engine(self):
        return self.residency.engine

    def attach(self, model, optimizer) -> None:
        """Called once the model is prepared and the dense optimizer built."""
        if self.dynamic is not None:
            self.dynamic.attach(model, optimizer)
        pid = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if is_expert_parameter(p):
                    self._expert_pids[pid] = p
                pid += 1
        if self.engine is not None and self.groups is not None:
            shards = [m for m in model.modules() if isinstance(m, ExpertShard)]
            assert len({(s.expert_ids, s.num_experts) for s in shards}) == 1, "uneven layers"
            self._first_expert = shards[0].expert_ids.start
            self._total_experts = shards[0].num_experts

    def load_model_state(self, model, state) -> None:
        if self.dynamic is not None:
            return self.dynamic.load_model_state(model, state)
        if self.engine is not None:     # the store holds the offloaded experts' weights
            offloaded = {name for name, m in model.named_modules()
                         if isinstance(m, OffloadedExpertsBase)}
            state = {k: v for k, v in state.items() if k.rpartition(".")[0] not in offloaded}
        if self.groups is None:
            return model.load_state_dict(state)
        load_full_state_dict(model, state, self.groups)

    # -- optimizer ---------------------------------------------------------------------
    def _expert_entry(self, name: str, value: torch.Tensor):
        if not name.startswith("optim."):
            return None
        param = self._expert_pids.get(int(name.split(".")[1]))
        if param is None or value.dim() == 0 or value.shape[1:] != param.shape[1:]:
            return None
        return param

    def local_optimizer_tensors(self, tensors):
        """This rank's optimizer tensors from single-process ones."""
        if self.dynamic is not None:
            return self.dynamic.local_optimizer_tensors(tensors)
        out = {}
        for name, value in tensors.items():
            param = self._expert_entry(name, value) if self.groups is not None else None
            if param is not None:
                local = param.shape[0]
                start = self.groups.ep_rank * local
                value = value[start:start + local].clone()
            out[name] = value
        return out

    def local_optimizer_groups(self, rest: dict) -> dict:
        return self.dynamic.local_optimizer_groups(rest) if self.dynamic is not None else rest

    def load_extra(self, ckpt_dir: Path, state: dict) -> None:
        """Restore the store (an expert-parallel rank: its slice of a store of all experts)."""
        if self.dynamic is not None:
            return self.dynamic.load_extra()
        if self.engine is None:
            return
        name = state.get("expert_store")
        if name is None:
            raise ValueError(f"the checkpoint of step {state.get('step')} has no expert store; "
                             "it was written without offloading: resume with the run's "
                             "config.toml")
        if not re.fullmatch(r"store_\d{8}", str(name)) or not (ckpt_dir / name).is_dir():
            raise StoreCheckpointError(f"the expert store {str(name)[:100]!r} of the checkpoint "
                                       f"of step {state.get('step')} is missing under "
                                       f"{str(ckpt_dir)!r}; the checkpoint is incomplete")
        first, total = (0, None) if self.groups is None else \
            (self._first_expert, self._total_experts)
        self.engine.load_checkpoint(str(ckpt_dir / name), first, total,
                                    tag=name[len("store_"):])
