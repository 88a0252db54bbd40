"""`moescale train --parallel.ep_size N --offload.mode host|pin|disk`: offloaded expert shards.

ES-MoE's offloading under FastMoE's static expert parallelism: each of the N ranks owns E/N
experts of every MoE layer (rank r: global experts [r*L, (r+1)*L)), and those local experts live
in that rank's own ExpertStore (host RAM, or one file per expert under
`<offload.disk_dir or run_dir/expert-store>/rank<r>`), streamed to the rank's device within its
budget and stepped by that rank's offload engine (host AdamW, eager or deferred). The static
dispatcher calls the offloaded experts' `forward_rows`; its all-to-all backward scales the
gradient (x 1/W into the experts, x W out), so the store accumulates each expert's gradient of
the mean loss over all tokens of all ranks, exactly as one process would.

Per step: backward -> dense gradients averaged over the world -> (deferred) the global norm from
the dense gradients (identical on every rank, counted once) plus the sum over the EP group of
each rank's expert accumulators (every expert counted once) -> the engine steps its experts
with the clip coefficient -> AdamW steps the dense parameters.

Checkpoints are consolidated: the model state is the single-process one (dense parameters, and
every layer's expert weights gathered from the ranks' stores into `...experts.w1_EDF` [E, ...]),
and rank 0 writes the gathered store records (masters, gradient accumulators, AdamW moments,
step counts of all E experts) as one ordinary store checkpoint `checkpoints/store_<step>/`
before the dense checkpoint (the commit point). Resume: each rank loads its experts' slice; a
one-process offloaded run (`offload.mode` host or disk) resumes it too, and the other way round.

Not supported (ValueError): more ranks than ep_size (data-parallel replicas of offloaded shards),
the pipelined all-to-all (parallel.chunks / parallel.reuse), offload.mode auto.
Costs: a checkpoint gathers all expert state into rank 0's RAM (one layer's records at a time
on the other ranks).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moescale.train.backends import OffloadBackend
from moescale.train.config import RunConfig
from moescale.train.ep_backend import ExpertParallelBackend


class ExpertParallelOffloadBackend(ExpertParallelBackend):
    """Static EP whose local experts are offloaded into a per-rank ExpertStore."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        super().__init__(config)
        if self.world_size != self.groups.ep_size:
            raise ValueError(f"offload.mode={config.offload.mode!r} with {self.world_size} "
                             f"processes and parallel.ep_size={self.groups.ep_size}: offloaded "
                             "expert shards are not replicated over data-parallel ranks; "
                             f"set parallel.ep_size {self.world_size} (one shard per rank)")
        run_dir = Path(self.agree(str(run_dir)))      # rank 0's choice, as the Trainer's
        self.offload = OffloadBackend(config, run_dir)
        self.offload.disk_dir = self.offload.disk_dir / f"rank{self.rank}"
        if config.offload.mode == "disk":
            self.offload.disk_dir.mkdir(parents=True, exist_ok=True)
        self._first_expert = self._total_experts = 0
        self._shard_names: list[tuple[str, torch.nn.Module]] = []   # (name, offloaded local)
        self._gathered: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def engine(self):
        return self.offload.engine

    def prepare(self, model) -> None:
        from moescale.parallel.expert_parallel import ExpertShard

        super().prepare(model)                  # shard over the EP group (static dispatcher)
        self.offload.prepare(model)             # then offload each rank's shard
        shards = [m for m in model.modules() if isinstance(m, ExpertShard)]
        assert len({(s.expert_ids, s.num_experts) for s in shards}) == 1, "uneven layers"
        self._first_expert = shards[0].expert_ids.start
        self._total_experts = shards[0].num_experts
        self._shard_names = [(name, m.local) for name, m in model.named_modules()
                             if isinstance(m, ExpertShard)]

    def attach(self, optimizer) -> None:
        super().attach(optimizer)
        self.offload.attach(optimizer)

    def begin_micro_batch(self, last: bool) -> None:
        self.offload.begin_micro_batch(last)

    def _sum_over_ep(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value.reshape(1), group=self.groups.ep_group,
                                what="expert grad-norm all-reduce")[0]

    def clip(self, model, max_norm: float) -> float | None:
        from moescale.parallel.grad_sync import allreduce_gradients

        allreduce_gradients(model, self.groups)  # the model holds dense parameters only
        if self.engine.config.step_mode != "deferred":
            return None      # eager: experts stepped during backward (grad_clip is 0)
        return self.engine.clip_grad_norm_(model.parameters(), max_norm,
                                           reduce_expert_sq=self._sum_over_ep)

    def step_experts(self) -> None:
        self.offload.step_experts()

    def before_backward(self, loss: torch.Tensor) -> None:
        self.offload.before_backward(loss)     # this rank's experts only

    def expert_skips(self) -> int:
        return self.offload.expert_skips()

    def skip_step(self) -> None:
        self.offload.skip_step()

    # checkpoints: the single-process model state and one store of all E experts
    def _gather_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All E records [E, 4, P] and step counts [E] of a store layer, on rank 0."""
        import torch.distributed as dist

        from moescale.parallel.all_to_all import collective_errors

        store = self.engine.store
        data, steps = zip(*(store.read_record((layer, e))
                            for e in range(store.num_experts[layer])))
        mine = torch.cat([torch.stack(data).reshape(-1), torch.tensor(steps)]).to(self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)] if self.writer \
            else None
        with collective_errors("expert-store gather", self.groups.ep_group):
            dist.gather(mine, parts, dst=0, group=self.groups.ep_group)
        if not self.writer:
            return None
        local, numel = store.num_experts[layer], store.layouts[layer].numel
        data_E4P = torch.cat([p[:local * 4 * numel].cpu().view(local, 4, numel) for p in parts])
        steps_E = torch.cat([p[local * 4 * numel:].cpu() for p in parts])
        return data_E4P, steps_E

    def model_state(self, model):
        self.engine.synchronize()
        state = super().model_state(model)       # dense entries
        gathered = [self._gather_layer(layer) for layer in range(len(self.engine.layers))]
        if not self.writer:
            return state
        self._gathered = gathered
        for name, local in self._shard_names:
            data_E4P, _ = gathered[local.layer_index]
            layout = self.engine.store.layouts[local.layer_index]
            parts = torch.split(data_E4P[:, 0], layout.sizes, dim=1)    # masters [E, P]
            for param, shape, part_EX in zip(layout.names, layout.shapes, parts):
                state[f"{name}.{param}"] = part_EX.reshape(-1, *shape).clone()
        return state

    def save_extra(self, ckpt_dir: Path, step: int) -> dict:
        from moescale.offload.checkpoint import save_records

        gathered, self._gathered = self._gathered, None
        assert gathered is not None, "model_state gathers the store before save_extra"
        target = self.offload._store_dir(ckpt_dir, step)
        target.mkdir(parents=True, exist_ok=True)
        store = self.engine.store
        save_records(str(target), f"{step:08d}", store.layouts,
                     [self._total_experts] * len(store.layouts),
                     lambda layer, e: (gathered[layer][0][e], float(gathered[layer][1][e])))
        return {"expert_store": target.name}

    def load_extra(self, ckpt_dir: Path, state: dict) -> None:
        self.offload.load_extra(ckpt_dir, state, self._first_expert, self._total_experts)

    def after_save(self, ckpt_dir: Path) -> None:
        self.offload.after_save(ckpt_dir)

    # summary
    def memory(self) -> dict:
        import torch.distributed as dist

        local = self.offload.memory()
        every = [None] * self.world_size
        dist.all_gather_object(every, local)
        out = {"device_peak_bytes": max(m["device_peak_bytes"] for m in every),
               "device_budget_bytes": local["device_budget_bytes"],
               "device_peak_bytes_per_rank": [m["device_peak_bytes"] for m in every]}
        for key in ("disk_bytes", "disk_read_bytes", "disk_written_bytes"):
            if key in local:
                out[key] = sum(m[key] for m in every)
        return out

    def plan(self, device) -> tuple[str, str]:
        name, text = self.offload.plan(device)
        where = "its own directory" if self.engine.store.config.tier == "disk" else "its RAM"
        return name, (f"{text}; experts split over {self.world_size} expert-parallel ranks, "
                      f"each rank's {self._total_experts // self.world_size} per layer in "
                      f"{where}")

    def close(self) -> None:
        self.offload.close()
