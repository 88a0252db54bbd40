"""`moescale train` under static expert parallelism (FastMoE, MPipeMoE): `ExpertParallelBackend`.

Picked by `make_backend` for `parallel.ep_size` > 1, or any multi-process launch: initializes
torch.distributed from torchrun's environment (or reuses the group `run_local` made), shards
every MoE layer over the expert-parallel group (plain or pipelined dispatcher per
`parallel.chunks` / `parallel.reuse`), gives each rank its slice of the rows of every batch
(the global batch is the union, so the loss is the mean over all tokens of all ranks), and
after backward averages gradients and clips by the global norm. Logged numbers (losses,
routed tokens) are reduced over the world; checkpoints are consolidated (`full_state_dict`
plus the experts' AdamW moments gathered the same way), so they equal a single-process
checkpoint and resume at any EP size. Only rank 0 writes files or prints. With more ranks
than `ep_size` (data-parallel replicas of each EP group, e.g. ep_size 1 on 2 ranks) the
balance loss is computed per EP group's tokens, as in ordinary data parallelism, so such a
run is not identical to one process (ep_size = world size is). Its step_metrics log static
placement's modelled per-rank load (max/mean rows) per step.

The offloaded (ep_offload_backend.py) and dynamic-placement (dynamic_backend.py) backends build
on it. Not here: the one-process backends and make_backend (backends.py), the loop.

Legend: B batch rows, W world size.
"""

from __future__ import annotations

import math
import os

import torch

from moescale.train.backends import LocalBackend, check_rows
from moescale.train.config import RunConfig


class ExpertParallelBackend(LocalBackend):
    """Experts split over the ranks of an expert-parallel group; each rank a slice of rows."""

    def __init__(self, config: RunConfig) -> None:
        import torch.distributed as dist

        from moescale.parallel.groups import ParallelConfig, init_distributed

        from moescale.models import gpt_config

        pc = config.parallel
        experts = config.model.num_experts or gpt_config(config.model.size).num_experts
        if experts % pc.ep_size:
            raise ValueError(f"parallel.ep_size={pc.ep_size} does not divide model.num_experts="
                             f"{experts}; choose num_experts as a multiple of ep_size")
        world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() \
            else dist.get_world_size()
        if world < pc.ep_size or world % pc.ep_size:
            raise ValueError(f"parallel.ep_size={pc.ep_size} needs a multiple of {pc.ep_size} "
                             f"processes, but {world} {'is' if world == 1 else 'are'} running; "
                             f"launch with `torchrun --nproc-per-node {pc.ep_size} -m moescale "
                             "train ...` (or moescale.train.backends.train_distributed)")
        check_rows(config, world)
        self.pconfig = ParallelConfig(ep_size=pc.ep_size, timeout_s=pc.timeout_s,
                                      chunks=pc.chunk_count(), reuse=pc.reuse)
        self.groups = init_distributed(self.pconfig)
        self.rank, self.world_size = self.groups.rank, self.groups.world_size
        self.writer = self.rank == 0
        self.device = torch.device("cpu") if dist.get_backend() == "gloo" else \
            torch.device("cuda", torch.cuda.current_device())
        self._expert_pids: dict[int, torch.nn.Parameter] = {}

    def prepare(self, model) -> None:
        from moescale.parallel.expert_parallel import expert_parallel_model
        from moescale.parallel.setup import dispatcher_factory

        expert_parallel_model(model, self.groups, dispatcher_factory(self.groups, self.pconfig))

    def attach(self, optimizer) -> None:
        from moescale.parallel.expert_parallel import is_expert_parameter

        pid = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if is_expert_parameter(p):
                    self._expert_pids[pid] = p
                pid += 1

    def shard(self, idx_BS, targets_BS):
        rows = idx_BS.shape[0] // self.world_size
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        return idx_BS[mine], targets_BS[mine]

    def clip(self, model, max_norm: float) -> float | None:
        from moescale.parallel.grad_sync import allreduce_gradients, clip_grad_norm_

        allreduce_gradients(model, self.groups)
        return float(clip_grad_norm_(model, max_norm if max_norm > 0 else math.inf,
                                     self.groups))

    def _all_reduce(self, t: torch.Tensor, op=None, group=None,
                    what: str = "training-metrics all-reduce") -> torch.Tensor:
        """`t` reduced (sum, or `op`) over `group` (None: the world), back on the CPU."""
        import torch.distributed as dist

        from moescale.parallel.all_to_all import collective_errors

        moved = t.to(self.device)
        with collective_errors(what, group):
            dist.all_reduce(moved, op=op or dist.ReduceOp.SUM, group=group)
        return moved.cpu()

    def mean(self, values: list[float]) -> list[float]:
        total = self._all_reduce(torch.tensor(values, dtype=torch.float64))
        return [v / self.world_size for v in total.tolist()]

    def sum_counts(self, counts):
        if not counts:
            return counts
        flat = self._all_reduce(torch.cat([c.reshape(-1) for c in counts]))
        return list(flat.split([c.numel() for c in counts]))

    def any(self, flag: bool) -> bool:
        return bool(self._all_reduce(torch.tensor([int(flag)]))[0])

    def agree(self, value):
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self._all_reduce(torch.zeros(1))

    # checkpoints: consolidated, independent of the rank count
    def model_state(self, model):
        from moescale.parallel.state import full_state_dict

        return full_state_dict(model, self.groups)

    def load_model_state(self, model, state) -> None:
        from moescale.parallel.state import load_full_state_dict

        load_full_state_dict(model, state, self.groups)

    def _expert_entry(self, name: str, value: torch.Tensor):
        if not name.startswith("optim."):
            return None
        pid = int(name.split(".")[1])
        param = self._expert_pids.get(pid)
        if param is None or value.dim() == 0 or value.shape[1:] != param.shape[1:]:
            return None
        return param

    def optimizer_tensors(self, optimizer, tensors):
        """Gather the expert moments (dim 0: local experts) over the EP group."""
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

    def local_optimizer_tensors(self, optimizer, tensors):
        """This rank's slice of consolidated expert moments."""
        out = {}
        for name, value in tensors.items():
            param = self._expert_entry(name, value)
            if param is not None:
                local = param.shape[0]
                start = self.groups.ep_rank * local
                value = value[start:start + local].clone()
            out[name] = value
        return out

    def step_metrics(self, model, counts_LE) -> dict:
        """Static placement's modelled per-rank load (rows) from the routed counts."""
        from moescale.parallel.dynamic import static_load_stats

        if not counts_LE or self.groups.ep_size == 1:
            return {}    # every rank holds every expert: no per-rank expert load
        stats = static_load_stats(counts_LE, self.groups.ep_size)
        return {f"device_load_{k}": v for k, v in stats.items()}

    def plan(self, device) -> tuple[str, str]:
        g, pc = self.groups, self.pconfig
        return "device-only", (f"device-only, experts split over {g.ep_size} expert-parallel "
                               f"ranks ({g.world_size} in all; chunks {pc.chunks}, reuse "
                               f"{pc.reuse}) on {device}")
