"""A run assembled from small parts: ranks, the experts' exchange, their residency, a step handle.

`assemble(config, run_dir)` builds, in this order:

1. the ranks (ranks.py): one process, or the ranks of a torch.distributed world, chosen by the
   world size;
2. the exchange (exchange.py): local, static expert-parallel (plain or pipelined all-to-all),
   or dynamic placement;
3. the residency (residency.py): resident, or offloaded into each rank's ExpertStore (host or
   disk tier); under dynamic placement the node's shared store (shared_store/residency.py);
   or the caller's own (`residency=`: residency.py's custom_residency).

`prepare(model)` applies the library's calls to the built model in the same order (exchange,
then residency) and keeps the expert-step handle the residency returns (moescale.expert_step:
a no-op for resident experts, the offload engine's host optimizer, or the shared store's
owners). The trainer's loop only talks to the ranks, the exchange (gradient sync, per-step
metrics), the step handle and the checkpoint state (run_state.py). No class exists per
combination: a part that cannot serve a combination refuses it with its own error. The
exchange and the residency are reached only through parts.py's Protocols.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

from moescale.train.config import RunConfig
from moescale.train.exchange import check_exchange, check_launch, make_exchange
from moescale.train.ranks import make_ranks, world_size_of_launch
from moescale.train.residency import check_residency, make_residency
from moescale.train.run_state import RunState


def check_parts(config: RunConfig) -> None:
    """Each part's refusals of options it cannot serve, before any process or thread starts."""
    pc = config.parallel
    if config.model.moe_every == 0 and (config.offload.tier != "device-only" or
                                        pc.placement == "dynamic" or (pc.ep_size or 1) > 1):
        raise ValueError(f"model.moe_every=0 builds a dense model: there are no experts to "
                         f"offload or place (offload.tier={config.offload.tier!r}, "
                         f"parallel.placement={pc.placement!r}, parallel.ep_size={pc.ep_size}); "
                         "drop those options or set model.moe_every >= 1")
    check_exchange(config)
    check_residency(config)


class Assembly:
    """The parts of one run (see the module docstring)."""

    def __init__(self, config: RunConfig, run_dir: Path, residency=None) -> None:
        if config.parallel.ep_size is None:     # the library's "the whole world"
            config.parallel = dataclasses.replace(config.parallel,
                                                  ep_size=world_size_of_launch())
        check_parts(config)
        check_launch(config)
        self.ranks = make_ranks(config.parallel.timeout_s, config.parallel.backend)
        run_dir = Path(self.ranks.agree(str(run_dir)))      # rank 0's choice
        self.run_dir = run_dir
        self.exchange = make_exchange(config, self.ranks)
        self.residency = make_residency(config, run_dir, self.ranks, self.exchange,
                                        custom=residency)
        self.step = None
        self.state = None
        self.train_model = None

    def expert_device(self) -> str | None:
        """Where the model's stacked experts are built ("meta": nowhere; None: with the rest)."""
        return self.residency.expert_device()

    def prepare(self, model) -> None:
        """After the model is built, before the optimizer: exchange, then residency."""
        self.state = RunState(self.exchange, self.residency, self.ranks, model)
        self.exchange.prepare(model)
        self.step = self.residency.prepare(model, self.exchange)

    def attach(self, model, optimizer) -> None:
        """Called with the dense optimizer once it exists (the model on its device);
        `train_model`: the module a training step calls (the exchange's training_module)."""
        self.step.follow(optimizer)
        self.state.attach(model, optimizer)
        self.train_model = self.exchange.training_module(model)

    def begin_micro_batch(self, last: bool) -> None:
        self.exchange.begin_micro_batch(last)
        self.step.begin_micro_batch(last)

    def clip(self, model, max_norm: float) -> float | None:
        """Gradients synchronised over the ranks, then clipped by the global norm (None: the
        experts already stepped during backward, eager offloading)."""
        self.exchange.sync_grads(model)
        return self.step.clip_grad_norm_(model, max_norm)

    def memory(self) -> dict:
        """The step handle's memory numbers (the largest device peak over the ranks, disk
        bytes summed)."""
        local = self.step.memory() if self.step is not None else {}
        if self.ranks.world_size == 1 or not local:
            return local
        every = self.ranks.gather_objects(local)
        out = {"device_peak_bytes": max(m["device_peak_bytes"] for m in every),
               "device_budget_bytes": local["device_budget_bytes"],
               "device_peak_bytes_per_rank": [m["device_peak_bytes"] for m in every]}
        for key in ("disk_bytes", "disk_read_bytes", "disk_written_bytes"):
            if key in local:
                out[key] = sum(m[key] for m in every)
        return out

    def plan(self, device) -> tuple[str, str]:
        """(short name, one line for the summary): the residency's words around the
        exchange's."""
        return self.residency.describe(device, self.exchange.describe())

    def close(self) -> None:
        self.residency.close()
        self.exchange.close()


def assemble(config: RunConfig, run_dir: str | Path, residency=None) -> Assembly:
    """The parts of a run of `config` in `run_dir` (see the module docstring); `residency`:
    the caller's own instead of `[offload]`'s (residency.py: custom_residency)."""
    return Assembly(config, Path(run_dir), residency)
