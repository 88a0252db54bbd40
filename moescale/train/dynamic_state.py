"""Dynamic placement resuming from a consolidated checkpoint (the format before sharded ones).

Under dynamic placement the experts live in the node's shared store (the residency's `store`,
`layers` and `layout`: shared_store/residency.py), not in the model, and the dense optimizer holds dense parameters only. A
consolidated checkpoint (legacy_state.py) holds the single-process state: expert weights
(model state) and their AdamW moments and step counts (optimizer state, at the single-process
parameter indices); the dense optimizer's entries are renumbered to this process's indices, and
every node's local rank 0 writes the experts into its store (the trainer's barrier follows
before anyone reads).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import torch

from moescale.layers.moe import MoE
from moescale.shared_store.experts import PARAM_NAMES
from moescale.train.optim import decay_groups

STORE_ROWS = {"exp_avg": 2, "exp_avg_sq": 3}   # offload.store EXP_AVG, EXP_AVG_SQ


class DynamicState:
    """Loads a consolidated checkpoint into the shared store + dense optimizer."""

    def __init__(self, residency, model_before_prepare) -> None:
        self.residency = residency
        self.expert_keys = {}        # single-process key "<moe>.experts.<name>" -> (layer, name)
        named = [(n, m) for n, m in model_before_prepare.named_modules()
                 if isinstance(m, MoE)]
        for i, (name, moe) in enumerate(named):
            for pname in PARAM_NAMES:
                if getattr(moe.experts, pname, None) is not None:
                    self.expert_keys[f"{name}.experts.{pname}"] = (i, pname)
        decay, no_decay = decay_groups(model_before_prepare)
        self.full_order = ([n for n, _ in decay], [n for n, _ in no_decay])
        self.local_order = ([], [])
        self._loaded = {}            # expert optimizer state read by local_optimizer_tensors

    def attach(self, model, optimizer) -> None:
        decay, no_decay = decay_groups(model)
        self.local_order = ([n for n, _ in decay], [n for n, _ in no_decay])
        assert [id(p) for _, p in decay + no_decay] == \
            [id(p) for g in optimizer.param_groups for p in g["params"]]

    @property
    def layers(self):
        return self.residency.layers

    def _slot(self, key: str):
        """(layer, [E, P_i] view of store row `row`'s slice, the tensor's shape) of a key."""
        layer_index, pname = self.expert_keys[key]
        layer = self.layers[layer_index]
        lay = layer.layout
        i = lay.names.index(pname)
        off = sum(lay.sizes[:i])
        return layer, (lambda row: layer.records()[:, row, off:off + lay.sizes[i]]), \
            (layer.num_experts, *lay.shapes[i])

    def _write_expert(self, key: str, row: int, value: torch.Tensor) -> None:
        layer, view, shape = self._slot(key)
        if tuple(value.shape) != shape:
            raise ValueError(f"{key}: the checkpoint holds shape {tuple(value.shape)}, this "
                             f"model {shape}")
        view(row).copy_(value.reshape(layer.num_experts, -1))

    def _step_t(self, layer_index: int, e: int) -> torch.Tensor:
        return self.residency.store.acquire((layer_index, e)).step_t

    def load_model_state(self, model, state) -> None:
        state = dict(state)
        experts = {k: state.pop(k) for k in self.expert_keys if k in state}
        missing = [k for k in self.expert_keys if k not in experts]
        if missing:
            raise KeyError(f"expert weights {missing[:3]} missing from the checkpoint")
        model.load_state_dict(state)
        if self.residency.layout.local_rank == 0:     # every node's store
            for key, value in experts.items():
                self._write_expert(key, 0, value)

    def _pid_maps(self):
        full = self.full_order[0] + self.full_order[1]
        local = {n: i for i, n in enumerate(self.local_order[0] + self.local_order[1])}
        return full, local

    def local_optimizer_groups(self, rest: dict) -> dict:
        full, local = self._pid_maps()
        if len(rest["param_groups"]) != 2 or \
                [len(g["params"]) for g in rest["param_groups"]] != [len(n) for n in
                                                                     self.full_order]:
            raise ValueError("the checkpoint's optimizer groups do not match this model")
        groups = [dict(g, params=[local[n] for n in names])
                  for g, names in zip(rest["param_groups"], self.local_order)]
        scalars = {}
        for k, v in rest["scalars"].items():
            pid, key = k.split(".", 1)
            if full[int(pid)] in local:
                scalars[f"{local[full[int(pid)]]}.{key}"] = v
        return {"param_groups": groups, "scalars": scalars}

    def local_optimizer_tensors(self, tensors):
        full, local = self._pid_maps()
        out, self._loaded = {}, {}
        for name, value in tensors.items():
            if not name.startswith("optim."):
                out[name] = value
                continue
            _, pid, key = name.split(".", 2)
            pname = full[int(pid)]
            if pname in self.expert_keys:
                self._loaded[pname, key] = value
            else:
                out[f"optim.{local[pname]}.{key}"] = value
        return out

    def load_extra(self) -> None:
        """Each node's local rank 0 writes the experts' moments and step counts into its
        store."""
        loaded, self._loaded = self._loaded, {}
        if self.residency.layout.local_rank != 0:
            return
        for (pname, key), value in loaded.items():
            if key in STORE_ROWS:
                self._write_expert(pname, STORE_ROWS[key], value)
            elif key == "step":
                layer_index = self.expert_keys[pname][0]
                for e in range(self.layers[layer_index].num_experts):
                    self._step_t(layer_index, e).fill_(float(value))
