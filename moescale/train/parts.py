"""The two Protocols a run is assembled from (as moescale.expert_step.ExpertStep is the third):
`Exchange` (how a layer's rows reach its experts) and `Residency` (where the experts live).

assembly.py builds one of each (exchange.py: make_exchange; residency.py: make_residency) and
talks to them only through these methods; no code asks which class or `kind` it holds. A new
exchange or residency is one class that has them (a residency may live outside train/, as
moescale.shared_store.residency's do, and needs to import nothing from here); a residency of
the caller's own reaches the trainer as `Trainer(config, run_dir, residency=...)`
(residency.py: custom_residency; tests/train/dict_residency.py is one in one file).

The order of a run: `exchange.prepare(model)` (shards or re-dispatches the MoE layers), then
`residency.prepare(model, exchange)`, which moves the experts where they live and returns the
expert-step handle (moescale.expert_step.ExpertStep). A residency reads of the exchange only
`groups` (moescale.parallel ParallelGroups or None) and, under dynamic placement, `layout`
(moescale.parallel.nodes NodeLayout).

Deliberately not here: construction (which exchange and residency a config asks for).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class Exchange(Protocol):
    """How tokens reach the experts: local, static EP (plain or pipelined), dynamic placement."""

    groups: object    # ParallelGroups of the expert-parallel / node group, None on one process

    def prepare(self, model: nn.Module) -> None:
        """Give the model's MoE layers this exchange's dispatcher (shard them if it shards)."""

    def training_module(self, model: nn.Module) -> nn.Module:
        """Once the model is on its device: the module a training step's forward and backward
        go through (the model, or DDP around it reducing the replicated dense gradients
        during backward). Collective; called once."""

    def sync_grads(self, model: nn.Module) -> None:
        """Average the gradients over the ranks that replicate them (after backward) that
        backward has not averaged yet."""

    def begin_micro_batch(self, last: bool) -> None: ...

    def step_metrics(self, model: nn.Module, counts_LE) -> dict:
        """What the exchange adds to each step's metrics record (modelled per-rank load...)."""

    def describe(self) -> str:
        """How the rows move, for the run's summary ("" on one process)."""

    def close(self) -> None: ...


@runtime_checkable
class Residency(Protocol):
    """Where the experts' weights and optimizer state live (see the module docstring)."""

    engine: object          # the per-process OffloadEngine its checkpoints go through, or None
    streams_experts: bool   # experts stream through a device budget: a step's wait_s counts

    def expert_device(self) -> str | None:
        """Where the model's stacked experts are built ("meta": nowhere; None: with the rest)."""

    def prepare(self, model: nn.Module, exchange: Exchange):
        """After exchange.prepare: move the experts where they live; the ExpertStep handle."""

    def shard_role(self, exchange: Exchange) -> tuple[bool, tuple[int, int] | None]:
        """(whether this rank writes expert shards, `share`): share = (index, count) when the
        experts are one store shared by `count` ranks of which this is `index`, each writing
        (and loading) its block (moescale.expert_state.save_expert_shards); None: the rank
        holds its own experts."""

    def describe(self, device, where: str) -> tuple[str, str]:
        """(short name, one line for the run's summary); `where`: the exchange's describe()."""

    def close(self) -> None: ...
