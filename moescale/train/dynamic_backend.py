"""`moescale train --parallel.placement dynamic`: one node-shared host copy of the experts, LPT.

`DynamicPlacementBackend` (picked by `make_backend`) runs on W = N x L ranks (torchrun, or
`train_distributed`), gloo, on the CPU: N nodes of L consecutive ranks (`parallel.node_size`;
0 = the ranks of a machine, so N = the machines; parallel/nodes.py):

- `prepare`: each node's local rank 0 puts every MoE layer's experts into one ExpertStore in
  /dev/shm that the node's ranks map (`node_expert_store`; every node its own, initialised
  from the same seed), and each MoE becomes a `dynamic_placement_moe` over it and the node
  group: every iteration each layer all-gathers the node's routed counts, plans the same LPT
  placement on the node's ranks (`parallel.split`: hot experts' rows sharded over devices),
  and moves rows to this iteration's owners and back. Balance-loss statistics are summed over
  the world (the single-process balance loss). The dense optimizer sees only dense parameters.
- each rank takes its slice of the batch rows (as expert parallelism does), so the global batch
  and the loss are the single-process ones;
- `clip`: dense gradients are averaged over the world; then each rank averages its share of
  the node's expert gradient accumulators over the nodes (`average_across_nodes`: the node
  accumulators hold node-mean gradients, their mean over nodes is the gradient of the mean
  loss over all tokens); the global gradient norm counts the dense part once plus every
  expert's accumulator once (the shares are disjoint within a node, summed over the node
  group; every node gets the same norm), and scales both (the single-process
  `clip_grad_norm_` over every parameter);
- `step_experts`: `step_shared_experts` over the node group with the dense optimizer's
  current lr, betas, eps and weight decay (every expert tensor is a matrix in the
  single-process model, so all decay): in each node each expert is stepped once, by its owner,
  between two barriers (the fence); the nodes step equal gradients with equal state, so their
  replicas stay bitwise equal;
- `step_metrics`: the modelled device load (rows; summed over the step's MoE calls) of the
  dynamic placement (the busiest node's max, the mean over all devices) and of static
  placement (expert e on rank e // (E / W)) from the same counts;
- checkpoints are consolidated into the single-process format: expert weights (model state)
  and their AdamW moments and step counts (optimizer state, single-process parameter indices)
  are read from (node 0's) store, so they resume at any layout and a single-process
  checkpoint resumes here. On resume every node's local rank 0 writes them into its store
  (the trainer's barrier follows before anyone reads).

Not here: placement across nodes (experts are replicated per node), GPUs (the shared-store
experts compute on the host copy), bf16, offloading combined with it (refused by
`RunConfig.check_supported`).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from moescale.train.backends import check_rows
from moescale.train.config import RunConfig
from moescale.train.ep_backend import ExpertParallelBackend

STORE_ROWS = {"exp_avg": 2, "exp_avg_sq": 3}   # offload.store EXP_AVG, EXP_AVG_SQ


def _launch_error(what: str) -> ValueError:
    return ValueError(f"parallel.placement='dynamic' {what}; launch with `torchrun "
                      "--nproc-per-node N -m moescale train --parallel.placement dynamic ...` "
                      "(or moescale.train.backends.train_distributed)")


class DynamicPlacementBackend(ExpertParallelBackend):
    """The ranks of a node share the experts; each iteration LPT places them; nodes hold
    replicas (see above)."""

    def __init__(self, config: RunConfig) -> None:   # not EP's __init__: its checks differ
        import torch.distributed as dist

        from moescale.parallel.groups import ParallelConfig, init_distributed
        from moescale.parallel.nodes import node_layout

        if not dist.is_initialized() and "RANK" not in os.environ:
            raise _launch_error("needs the processes of a distributed launch")
        world = dist.get_world_size() if dist.is_initialized() else \
            int(os.environ["WORLD_SIZE"])
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
        self.layout = node_layout(world, rank, config.parallel.node_size, os.environ)
        check_rows(config, world)
        if dist.is_initialized() and dist.get_backend() != "gloo":
            raise ValueError(f"parallel.placement='dynamic' computes experts on the host copy "
                             f"and needs the gloo backend; the process group uses "
                             f"{dist.get_backend()}")
        if config.train.device == "auto":
            config.train.device = "cpu"    # the shared-store experts compute on the host
        self.config = config
        # ep_group: the node's L consecutive ranks; dp_group: the same local rank on every node
        self.groups = init_distributed(ParallelConfig(ep_size=self.layout.node_size,
                                                      backend="gloo",
                                                      timeout_s=config.parallel.timeout_s))
        self.rank, self.world_size = self.groups.rank, self.groups.world_size
        self.writer = self.rank == 0
        self.device = torch.device("cpu")
        self.store = None
        self.layers = []             # SharedStoreExperts, store layer order
        self.expert_keys = {}        # single-process key "<moe>.experts.<name>" -> (layer, name)
        self.full_order = ([], [])   # single-process optimizer names: (decay, no_decay)
        self.local_order = ([], [])
        self.optimizer = None
        self._loaded = {}            # expert optimizer state read by local_optimizer_tensors
        self._calls = []             # placement_stats of this step's micro-batches
        self._micro = 0
        self._model = None

    # -- model -------------------------------------------------------------------------
    def prepare(self, model) -> None:
        import torch.distributed as dist

        from moescale.layers.moe import MoE
        from moescale.parallel.dynamic_experts import PARAM_NAMES, dynamic_placement_moe
        from moescale.parallel.node_store import node_expert_store
        from moescale.parallel.placement import PlacementConfig
        from moescale.train.optim import decay_groups

        named = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
        decay, no_decay = decay_groups(model)
        self.full_order = ([n for n, _ in decay], [n for n, _ in no_decay])
        for i, (name, moe) in enumerate(named):
            for pname in PARAM_NAMES:
                if getattr(moe.experts, pname, None) is not None:
                    self.expert_keys[f"{name}.experts.{pname}"] = (i, pname)
        node = self.groups.ep_group
        self.store = node_expert_store([m for _, m in named], node, node=self.layout.node)
        index = {id(m): i for i, (_, m) in enumerate(named)}
        placement = PlacementConfig(num_devices=self.layout.node_size,
                                    split=self.config.parallel.split)
        rng = torch.get_rng_state()     # building layers must not shift the run's RNG stream
        for module in list(model.modules()):
            for cname, child in list(module.named_children()):
                if isinstance(child, MoE) and id(child) in index:
                    setattr(module, cname, dynamic_placement_moe(
                        child, self.store, index[id(child)], node, placement,
                        stats_group=dist.group.WORLD))
        torch.set_rng_state(rng)
        self.layers = [m.experts for m in model.modules() if isinstance(m, MoE)]
        self._model = model
        assert [x.layer_index for x in self.layers] == list(range(len(named)))

    def attach(self, optimizer) -> None:
        from moescale.train.optim import decay_groups

        self.optimizer = optimizer
        decay, no_decay = decay_groups(self._model)
        self.local_order = ([n for n, _ in decay], [n for n, _ in no_decay])
        assert [id(p) for _, p in decay + no_decay] == \
            [id(p) for g in optimizer.param_groups for p in g["params"]]

    # -- the step ----------------------------------------------------------------------
    def clip(self, model, max_norm: float) -> float | None:
        from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_
        from moescale.parallel.nodes import average_across_nodes

        allreduce_gradients(model, self.groups)   # after it every backward has finished
        # this rank's share of the node's experts, averaged over the nodes: every expert is
        # counted once per node, and the norm is summed over the node group (groups.ep_group)
        mine = average_across_nodes(self.layers, self.layout, self.groups.dp_group)
        return float(clip_grad_norm_(model, max_norm if max_norm > 0 else math.inf,
                                     self.groups, extra_grads=mine))

    def step_experts(self) -> None:
        from moescale.parallel.dynamic_experts import step_shared_experts

        oc = self.config.optim
        # its first barrier: every share is averaged and clipped before any owner steps
        step_shared_experts(self.layers, self.groups.ep_group,
                            lr=self.optimizer.param_groups[0]["lr"],
                            betas=(oc.beta1, oc.beta2), eps=oc.eps,
                            weight_decay=oc.weight_decay)

    def skip_step(self) -> None:
        from moescale.parallel.dynamic_experts import step_shared_experts

        # the same fence, no step: each owner zeroes its experts' accumulators
        step_shared_experts(self.layers, self.groups.ep_group, lr=0.0, skip=True)

    def begin_micro_batch(self, last: bool) -> None:
        self._collect(keep=self._micro > 0)   # the first one drops evaluation's calls
        self._micro += 1

    def _collect(self, keep: bool) -> None:
        from moescale.parallel.dynamic import (
            DynamicPlacementDispatcher,
            placement_stats,
        )

        stats = placement_stats(self._model)
        if keep and stats:
            self._calls.append(stats)
        for module in self._model.modules():
            if isinstance(getattr(module, "dispatcher", None), DynamicPlacementDispatcher):
                module.dispatcher.stats = None

    def step_metrics(self, model, counts) -> dict:
        from moescale.parallel.dynamic import static_load_stats

        self._collect(keep=True)
        calls, self._calls, self._micro = self._calls, [], 0
        max_load = sum(c["placement_max_load"] for c in calls)
        mean_load = sum(c["placement_mean_load"] for c in calls)
        worst = max((c["placement_max_over_mean"] for c in calls), default=1.0)
        split = sum(c["placement_split_experts"] for c in calls)
        if self.layout.num_nodes > 1:     # the busiest node's max, the mean over all devices
            max_load, worst = self._over_nodes([max_load, worst], "max")
            mean_load, split = self._over_nodes([mean_load, split], "sum")
            mean_load /= self.layout.num_nodes
        out = {"device_load_max": max_load, "device_load_mean": mean_load,
               "device_load_max_over_mean": max_load / mean_load if mean_load > 0 else 1.0,
               "device_load_worst_layer": worst, "split_experts": int(split)}
        if counts and all(len(c) % self.world_size == 0 for c in counts):
            static = static_load_stats(counts, self.world_size)
            out.update({f"static_load_{k}": v for k, v in static.items()})
        return out

    def _over_nodes(self, values: list[float], op: str) -> list[float]:
        """`values` reduced (max or sum) over the inter-node group."""
        import torch.distributed as dist

        return self._all_reduce(torch.tensor(values, dtype=torch.float64),
                                dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                                self.groups.dp_group, "placement-statistics all-reduce").tolist()

    # -- checkpoints: the single-process format ------------------------------------------
    def _slot(self, key: str):
        """(layer, [E, P_i] view of store row `row`'s slice, the tensor's shape) of an expert
        key."""
        layer_index, pname = self.expert_keys[key]
        layer = self.layers[layer_index]
        lay = layer.layout
        i = lay.names.index(pname)
        off = sum(lay.sizes[:i])
        return layer, (lambda row: layer.records()[:, row, off:off + lay.sizes[i]]), \
            (layer.num_experts, *lay.shapes[i])

    def _expert_tensor(self, key: str, row: int) -> torch.Tensor:
        """The single-process tensor [E, ...] of store row `row` (0 masters, 2/3 moments)."""
        _, view, shape = self._slot(key)
        return view(row).reshape(shape).clone()

    def _write_expert(self, key: str, row: int, value: torch.Tensor) -> None:
        layer, view, shape = self._slot(key)
        if tuple(value.shape) != shape:
            raise ValueError(f"{key}: the checkpoint holds shape {tuple(value.shape)}, this "
                             f"model {shape}")
        view(row).copy_(value.reshape(layer.num_experts, -1))

    def _step_t(self, layer_index: int, e: int) -> torch.Tensor:
        return self.store.acquire((layer_index, e)).step_t

    def model_state(self, model):
        state = dict(model.state_dict())
        for key in self.expert_keys:
            state[key] = self._expert_tensor(key, 0)
        return state

    def load_model_state(self, model, state) -> None:
        state = dict(state)
        experts = {k: state.pop(k) for k in self.expert_keys if k in state}
        missing = [k for k in self.expert_keys if k not in experts]
        if missing:
            raise KeyError(f"expert weights {missing[:3]} missing from the checkpoint")
        model.load_state_dict(state)
        if self.layout.local_rank == 0:     # every node's store
            for key, value in experts.items():
                self._write_expert(key, 0, value)

    def _pid_maps(self):
        full = self.full_order[0] + self.full_order[1]
        local = {n: i for i, n in enumerate(self.local_order[0] + self.local_order[1])}
        return full, local

    def optimizer_tensors(self, optimizer, tensors):
        """Dense moments renumbered to the single-process indices, plus the experts'."""
        full, local = self._pid_maps()
        by_local = {}
        for name, value in tensors.items():
            _, pid, key = name.split(".", 2)
            by_local.setdefault(int(pid), {})[key] = value
        out = {}
        for full_pid, pname in enumerate(full):
            if pname in self.expert_keys:
                layer_index = self.expert_keys[pname][0]
                step_t = self._step_t(layer_index, 0)
                if float(step_t) == 0:
                    continue     # not stepped yet: no state, as torch's AdamW
                out[f"optim.{full_pid}.step"] = step_t.clone()
                for key, row in STORE_ROWS.items():
                    out[f"optim.{full_pid}.{key}"] = self._expert_tensor(pname, row)
            else:
                for key, value in by_local.get(local[pname], {}).items():
                    out[f"optim.{full_pid}.{key}"] = value
        return out

    def optimizer_groups(self, rest: dict) -> dict:
        full, local = self._pid_maps()
        index = {n: i for i, n in enumerate(full)}
        inverse = {i: n for n, i in local.items()}
        groups = [dict(g, params=[index[n] for n in names])
                  for g, names in zip(rest["param_groups"], self.full_order)]
        scalars = {f"{index[inverse[int(k.split('.', 1)[0])]]}.{k.split('.', 1)[1]}": v
                   for k, v in rest["scalars"].items()}
        return {"param_groups": groups, "scalars": scalars}

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

    def local_optimizer_tensors(self, optimizer, tensors):
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

    def load_extra(self, ckpt_dir: Path, state: dict) -> None:
        """Each node's local rank 0 writes the experts' moments and step counts into its
        store."""
        loaded, self._loaded = self._loaded, {}
        if self.layout.local_rank != 0:
            return
        for (pname, key), value in loaded.items():
            if key in STORE_ROWS:
                self._write_expert(pname, STORE_ROWS[key], value)
            elif key == "step":
                layer_index = self.expert_keys[pname][0]
                for e in range(self.layers[layer_index].num_experts):
                    self._step_t(layer_index, e).fill_(float(value))

    # -- summary -----------------------------------------------------------------------
    def plan(self, device) -> tuple[str, str]:
        from moescale.offload.planner import fmt_bytes

        nbytes = sum(x.records().numel() * 4 for x in self.layers)
        how = "LPT + hot-expert splitting" if self.config.parallel.split else "LPT"
        nodes = self.layout.num_nodes
        where = "" if nodes == 1 else (f" on each of {nodes} nodes (replicas, gradients "
                                       f"averaged across nodes)")
        return "device-only", (f"device-only, experts in one host copy shared by the "
                               f"{self.layout.node_size} local ranks{where} "
                               f"({fmt_bytes(nbytes)} in /dev/shm: weights, gradients, AdamW "
                               f"moments), placed each iteration by {how} on {device}")

    def close(self) -> None:
        self.store = None     # the mapping goes with the last reference (the file is gone)

