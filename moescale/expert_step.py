"""The expert-step handle: what a training loop calls so that the experts learn, wherever they live.

Resident experts are ordinary parameters: the user's optimizer steps them, so their handle
(`ResidentStep`) only clips (torch's global-norm clipping on one process; over the
expert-parallel group's disjoint shards with `groups`). Offloaded experts are stepped by the
offload engine's host optimizer (`moescale.offload.stepping.OffloadStep`); experts in a
node-shared store by their owner of the iteration (`moescale.shared_store.step.
SharedStoreStep`). All three satisfy `ExpertStep`, so a loop is written once:

    step = ResidentStep()                      # or OffloadStep(engine), SharedStoreStep(...)
    step.follow(optimizer)
    for i in range(accum):
        step.begin_micro_batch(last=i == accum - 1)
        loss = ...; step.before_backward(loss.detach()); loss.backward()
    norm = step.clip_grad_norm_(model, max_norm)   # None: experts already stepped (eager)
    step.step(); optimizer.step()                  # or step.skip_step() to discard the step
    waited = step.take_wait_s()   # seconds compute waited for experts since the last take

Gradient averaging over data-parallel ranks is the exchange's business (it runs before clip).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ExpertStep(Protocol):
    """The per-step calls of a training loop for the experts (see the module docstring)."""

    def follow(self, optimizer: torch.optim.Optimizer) -> None: ...
    def begin_micro_batch(self, last: bool) -> None: ...
    def before_backward(self, loss: torch.Tensor) -> None: ...
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float | None: ...
    def skipped_steps(self) -> int: ...
    def step(self) -> None: ...
    def skip_step(self) -> None: ...
    def take_wait_s(self) -> float: ...
    def memory(self) -> dict: ...
    def close(self) -> None: ...


class ResidentStep:
    """Experts that are parameters of the model: stepped by the user's optimizer.

    `groups` (moescale.parallel ParallelGroups): the model's experts are expert-parallel
    shards; the global norm then sums their part over the EP group."""

    def __init__(self, groups=None) -> None:
        self.groups = groups

    def follow(self, optimizer) -> None:
        pass

    def begin_micro_batch(self, last: bool) -> None:
        pass

    def before_backward(self, loss) -> None:
        pass

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        if self.groups is None:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        from moescale.parallel.grad_sync import clip_grad_norm_

        return float(clip_grad_norm_(model, max_norm if max_norm > 0 else math.inf,
                                     self.groups))

    def skipped_steps(self) -> int:
        return 0

    def step(self) -> None:
        pass

    def skip_step(self) -> None:
        pass

    def take_wait_s(self) -> float:
        return 0.0        # nothing to wait for: every expert is on the device

    def memory(self) -> dict:
        return {}

    def close(self) -> None:
        pass
