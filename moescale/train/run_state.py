"""A run's checkpoint state in the single-process format, whatever its exchange and residency.

`RunState(exchange, residency, ranks)` gives the trainer the tensors of a checkpoint and loads
them back; it composes what each part contributes:

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

Costs: a consolidated checkpoint gathers every expert into rank 0's RAM (one layer's records at
a time on the other ranks).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from moescale.train.checkpoint import list_checkpoints


def _store_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"store_{step:08d}"


class RunState:
    """Checkpoint tensors of a run (see the module docstring)."""

    def __init__(self, exchange, residency, ranks, model) -> None:
        self.exchange, self.residency, self.ranks = exchange, residency, ranks
        self.dynamic = None
        if exchange.kind == "dynamic":
            from moescale.train.dynamic_state import DynamicState
            self.dynamic = DynamicState(exchange, model)
        self._expert_pids: dict[int, torch.nn.Parameter] = {}
        self._gathered = None
        self._shard_names = []      # (name, offloaded local experts) of EP offloaded layers

    @property
    def groups(self):
        return self.exchange.groups

    @property
    def engine(self):
        return self.residency.engine

    def attach(self, model, optimizer) -> None:
        """Called once the model is prepared and the dense optimizer built."""
        from moescale.parallel.expert_parallel import ExpertShard, is_expert_parameter

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
            self._shard_names = [(name, m.local) for name, m in model.named_modules()
                                 if isinstance(m, ExpertShard)]

    # -- model -------------------------------------------------------------------------
    def model_state(self, model) -> dict[str, torch.Tensor]:
        if self.dynamic is not None:
            return self.dynamic.model_state(model)
        if self.groups is None:
            return model.state_dict()
        from moescale.parallel.state import full_state_dict

        if self.engine is not None:
            self.engine.synchronize()
        state = full_state_dict(model, self.groups)
        if self.engine is not None:
            self._add_gathered_masters(state)
        return state

    def load_model_state(self, model, state) -> None:
        if self.dynamic is not None:
            return self.dynamic.load_model_state(model, state)
        if self.engine is not None:     # the store holds the offloaded experts' weights
            from moescale.offload.experts import OffloadedExpertsBase

            offloaded = {name for name, m in model.named_modules()
                         if isinstance(m, OffloadedExpertsBase)}
            state = {k: v for k, v in state.items() if k.rpartition(".")[0] not in offloaded}
        if self.groups is None:
            return model.load_state_dict(state)
        from moescale.parallel.state import load_full_state_dict

        load_full_state_dict(model, state, self.groups)

    # -- optimizer ---------------------------------------------------------------------
    def _expert_entry(self, name: str, value: torch.Tensor):
        if not name.startswith("optim."):
            return None
        param = self._expert_pids.get(int(name.split(".")[1]))
        if param is None or value.dim() == 0 or value.shape[1:] != param.shape[1:]:
            return None
        return param

    def optimizer_tensors(self, tensors):
        """The single-process optimizer tensors (expert moments gathered over the EP group)."""
        if self.dynamic is not None:
            return self.dynamic.optimizer_tensors(tensors)
        if self.groups is None or not self._expert_pids:
            return tensors
        import torch.distributed as dist

        from moescale.parallel.all_to_all import collective_errors

        out = {}
        for name in sorted(tensors):
            value = tensors[name]
            if self._expert_entry(name, value) is not None:
                parts = [torch.empty_like(value) for _ in range(self.groups.ep_size)]
                with collective_errors("optimizer-state gather", self.groups.ep_group):
                    dist.all_gather(parts, value.contiguous(), group=self.groups.ep_group)
                value = torch.cat(parts, 0)
            out[name] = value
        return out

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

    def optimizer_groups(self, rest: dict) -> dict:
        return self.dynamic.optimizer_groups(rest) if self.dynamic is not None else rest

    def local_optimizer_groups(self, rest: dict) -> dict:
        return self.dynamic.local_optimizer_groups(rest) if self.dynamic is not None else rest

    # -- the expert store of an offloaded run ------------------------------------------
    def _gather_layer(self, layer: int):
        """All E records [E, 4, P] and step counts [E] of a store layer, on rank 0."""
        import torch.distributed as dist

        from moescale.parallel.all_to_all import collective_errors

        store = self.engine.store
        data, steps = zip(*(store.read_record((layer, e))
                            for e in range(store.num_experts[layer])))
        mine = torch.cat([torch.stack(data).reshape(-1), torch.tensor(steps)]).to(
            self.ranks.device)
        parts = [torch.empty_like(mine) for _ in range(self.ranks.world_size)] \
            if self.ranks.writer else None
        with collective_errors("expert-store gather", self.groups.ep_group):
            dist.gather(mine, parts, dst=0, group=self.groups.ep_group)
        if not self.ranks.writer:
            return None
        local, numel = store.num_experts[layer], store.layouts[layer].numel
        data_E4P = torch.cat([p[:local * 4 * numel].cpu().view(local, 4, numel) for p in parts])
        steps_E = torch.cat([p[local * 4 * numel:].cpu() for p in parts])
        return data_E4P, steps_E

    def _add_gathered_masters(self, state) -> None:
        gathered = [self._gather_layer(layer) for layer in range(len(self.engine.layers))]
        if not self.ranks.writer:
            return
        self._gathered = gathered
        for name, local in self._shard_names:
            data_E4P, _ = gathered[local.layer_index]
            layout = self.engine.store.layouts[local.layer_index]
            parts = torch.split(data_E4P[:, 0], layout.sizes, dim=1)    # masters [E, P]
            for param, shape, part_EX in zip(layout.names, layout.shapes, parts):
                state[f"{name}.{param}"] = part_EX.reshape(-1, *shape).clone()

    def save_extra(self, ckpt_dir: Path, step: int) -> dict:
        """Rank 0, before the dense checkpoint: the offloaded experts' store."""
        if self.engine is None:
            return {}
        target = _store_dir(ckpt_dir, step)
        target.mkdir(parents=True, exist_ok=True)
        if self.groups is None:
            self.engine.save_checkpoint(str(target), tag=f"{step:08d}")
            return {"expert_store": target.name}
        from moescale.offload.checkpoint import save_records

        gathered, self._gathered = self._gathered, None
        assert gathered is not None, "model_state gathers the store before save_extra"
        store = self.engine.store
        save_records(str(target), f"{step:08d}", store.layouts,
                     [self._total_experts] * len(store.layouts),
                     lambda layer, e: (gathered[layer][0][e], float(gathered[layer][1][e])))
        return {"expert_store": target.name}

    def load_extra(self, ckpt_dir: Path, state: dict) -> None:
        """Restore the store (an expert-parallel rank: its slice of a store of all experts)."""
        if self.dynamic is not None:
            return self.dynamic.load_extra()
        if self.engine is None:
            return
        from moescale.offload.checkpoint import StoreCheckpointError

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

    def after_save(self, ckpt_dir: Path) -> None:
        if self.engine is None:
            return
        kept = {f"store_{step:08d}" for step, _ in list_checkpoints(ckpt_dir)}
        for entry in ckpt_dir.iterdir():
            if entry.name.startswith("store_") and entry.name not in kept and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
