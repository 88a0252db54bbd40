"""The step guard of `moescale train`: a diverging step never reaches the weights.

Before the optimizer steps, `StepGuard.verdict` looks at the step's loss (cross-entropy and
balance loss, averaged over ranks, so every rank decides alike), its gradient norm (the global
one the backend clipped by; in eager offload mode, where experts step during backward and no
global norm exists, the dense gradients' norm) and the expert steps the host optimizer refused
during backward. A step is skipped when any of them is not finite, or when the gradient norm is
at least sqrt(float32 max) ~ 1.8e19: its square, AdamW's second moment, would overflow to
infinity and poison the optimizer state with finite weights. A skipped step applies no
optimizer update (dense or experts; gradients are discarded), still advances the step counter
and the data (the next step sees the next batch), is logged as one line on stderr and marked
in metrics.jsonl (`"skipped": reason`). `train.max_skips` consecutive skipped steps stop the
run with one line (`TrainingDiverged`; `moescale train` exits 3; the trainer adds which
checkpoint to continue from, trust.py).

Eager offload mode (`offload.step_mode eager`) steps each expert on the host as soon as its
gradient is complete, before the step's gradient norm exists. There the host optimizer checks
each expert's gradient norm the same way and never steps an expert whose gradient is not finite
(or would overflow), counting the refusals; and a non-finite loss is seen before backward, so
no expert of that step is stepped at all (one process; under expert parallelism each rank's own
experts are checked one by one). Experts with finite gradients in a step whose dense gradient
turns out non-finite have already been stepped: the guard skips the dense step and logs it.

Deliberately not here: the checkpoint side (checkpoint.py refuses to write or load
non-finite tensors), the loop (trainer.py).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

OVERFLOW_NORM = math.sqrt(torch.finfo(torch.float32).max)   # ~1.8e19


class TrainingDiverged(RuntimeError):
    """`train.max_skips` consecutive steps had a non-finite loss or gradient."""


def norm_trouble(norm: float | None) -> str | None:
    """Why a gradient norm cannot be stepped with (None: it can)."""
    if norm is None:
        return None
    if not math.isfinite(norm):
        return f"gradient norm {norm}"
    if norm >= OVERFLOW_NORM:
        return f"gradient norm {norm:.3g} (its square overflows float32)"
    return None


def dense_grad_norm(params: Iterable[torch.Tensor]) -> float:
    """The 2-norm of the gradients of `params` (those that have one), as a float."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads))


class StepGuard:
    """Decides whether a step may update the weights; counts and reports skipped steps."""

    def __init__(self, max_skips: int, err, run_dir: str = "RUN_DIR") -> None:
        self.max_skips = max_skips
        self.err = err
        self.run_dir = run_dir
        self.skipped = 0          # skipped steps in this process's run
        self.consecutive = 0

    @staticmethod
    def verdict(loss: float, aux_loss: float, grad_norm: float | None,
                expert_skips: int = 0) -> str | None:
        """None when the step may update the weights, else why it may not (one phrase)."""
        if not math.isfinite(loss):
            return f"loss {loss}"
        if not math.isfinite(aux_loss):
            return f"balance loss {aux_loss}"
        trouble = norm_trouble(grad_norm)
        if trouble is not None:
            return trouble
        if expert_skips:
            return f"{expert_skips} expert gradient(s) not finite"
        return None

    def check_trained(self, steps_run: int) -> None:
        """TrainingDiverged when every one of this process's `steps_run` steps was skipped
        (fewer than max_skips, e.g. a huge model.aux_loss_coef): nothing was trained."""
        if steps_run and self.skipped == steps_run:
            raise TrainingDiverged(
                f"training diverged: every one of the {steps_run} steps run had a non-finite "
                "loss or gradient and was skipped, so nothing was trained (check "
                "model.aux_loss_coef, model.z_loss_coef and optim.lr)")

    def record(self, step: int, reason: str | None) -> None:
        """Account for step `step` (1-based, after the update or its skip): one stderr line
        per skipped step; TrainingDiverged after max_skips skipped in a row."""
        if reason is None:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        print(f"step {step}: skipped the optimizer step ({reason}); {self.consecutive} in a "
              f"row, the run stops at train.max_skips={self.max_skips}", file=self.err)
        if self.consecutive >= self.max_skips:
            raise TrainingDiverged(
                f"training diverged: {self.consecutive} steps in a row up to step {step} had a "
                f"non-finite loss or gradient (last: {reason}); no update was applied and every "
                "checkpoint holds finite weights; lower optim.lr (or raise optim.warmup_steps, "
                "enable optim.grad_clip)")
