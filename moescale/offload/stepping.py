"""`OffloadStep(engine)`: the expert-step handle (moescale.expert_step) of offloaded experts.

The offload engine's host optimizer steps the experts: in deferred mode after the global-norm
clip (`clip_grad_norm_` folds the experts' accumulated gradients into the norm and scales them
at the step), in eager mode during the last micro-batch's backward, as each expert's gradient
completes (there is then nothing to clip: `clip_grad_norm_` returns None). A non-finite loss in
eager mode holds this step's expert steps (`before_backward`), so that the loop's guard can
discard the step. `reduce_expert_sq` sums the experts' squared norm over the ranks whose stores
hold disjoint experts (expert parallelism: an all-reduce over the EP group), given by the
caller so that nothing here depends on how experts are exchanged.
"""

from __future__ import annotations

import os

import torch


def dir_bytes(path) -> int:
    """Bytes of the files under `path` (files vanishing meanwhile count 0)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class OffloadStep:
    """The ExpertStep of an OffloadEngine (see the module docstring)."""

    def __init__(self, engine, reduce_expert_sq=None) -> None:
        self.engine = engine
        self.reduce_expert_sq = reduce_expert_sq
        self._held = False      # eager: a non-finite loss this step, no expert steps

    def follow(self, optimizer) -> None:
        self.engine.follow(optimizer)

    def begin_micro_batch(self, last: bool) -> None:
        self.engine.begin_micro_batch(last=last and not self._held)

    def before_backward(self, loss: torch.Tensor) -> None:
        if self.engine.step_mode == "eager" and not bool(torch.isfinite(loss).all()):
            self._held = True
            self.engine.begin_micro_batch(last=False)

    def clip_grad_norm_(self, model, max_norm: float) -> float | None:
        if self.engine.step_mode != "deferred":
            return None      # eager: experts stepped during backward (grad_clip is 0)
        return self.engine.clip_grad_norm_(model.parameters(), max_norm,
                                           reduce_expert_sq=self.reduce_expert_sq)

    def skipped_steps(self) -> int:
        if self.engine.step_mode == "eager":
            self.engine.optimizer.wait_all()     # the steps queued during backward
        return self.engine.optimizer.skipped_steps

    def step(self) -> None:
        self._held = False
        self.engine.step()

    def skip_step(self) -> None:
        self._held = False
        self.engine.skip_step()

    def take_wait_s(self) -> float:
        return self.engine.take_wait_s()

    def memory(self) -> dict:
        """The device's peak and budget; for the disk tier the store's file and I/O bytes."""
        return self.engine.memory()

    def close(self) -> None:
        self.engine.close()
