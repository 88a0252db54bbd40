"""Which checkpoints a run trusts: a good one from before the last loss spike is always kept.

Divergence can ruin the weights while every value stays finite (lr 1e6: from the second step
the loss is ln(vocabulary) and the gradient zero, NaN only later), so a checkpoint written
shortly before the step guard stops a run may hold a destroyed model with a valid checksum.
The rule:

- an *anomaly* is a skipped step (guard.py) or a loss spike: a loss above SPIKE_RATIO (1.5) x
  the median of the last SPIKE_HISTORY (20) losses (once 5 are known);
- the checkpoint of step s is *trusted* once the TRUST_STEPS (10) steps after it have run
  without an anomaly;
- the initial state (step 0) is a safety net only: it is removed as soon as it is neither the
  anchor nor the candidate;
- retention keeps, whatever `train.keep_last` says, the newest trusted checkpoint (the
  *anchor*) and the oldest one after it (the *candidate*, the next anchor; with no anchor yet,
  the oldest checkpoint: a fresh run writes its initial state as step 0), besides the newest
  `keep_last` (a run that ends normally, with no anomaly in its last TRUST_STEPS steps, keeps
  only the newest `keep_last`: a continuation starts from its last checkpoint);
- when the guard stops the run, every checkpoint newer than the anchor (or than the candidate
  when no checkpoint is trusted yet) was written within TRUST_STEPS of an anomaly and is not
  trusted over it: the trainer sets them aside as `<name>.diverged` (kept, never loaded), so
  `--resume` continues from that checkpoint, and the stop message names it.

A resumed run rebuilds the history from metrics.jsonl. Not here: the guard's own verdicts
(guard.py), writing and deleting files (checkpoint.py, trainer.py).
"""

from __future__ import annotations

import statistics
from collections import deque

TRUST_STEPS = 10
SPIKE_RATIO = 1.5
SPIKE_HISTORY = 20


class CheckpointTrust:
    """The loss history of a run and the checkpoints it trusts (see the module docstring)."""

    def __init__(self) -> None:
        self.anomalies: list[int] = []
        self._recent: deque[float] = deque(maxlen=SPIKE_HISTORY)

    def note(self, step: int, loss: float, skipped: str | None) -> None:
        """Step `step`'s loss (and whether the guard skipped it)."""
        spike = len(self._recent) >= 5 and loss > SPIKE_RATIO * statistics.median(self._recent)
        if skipped or spike:
            self.anomalies.append(step)
        if not skipped:
            self._recent.append(loss)

    def trusted(self, step: int, now: int) -> bool:
        return step + TRUST_STEPS <= now and not any(
            step < a <= step + TRUST_STEPS for a in self.anomalies)

    def _anchor(self, steps: list[int], now: int) -> int | None:
        return max((s for s in steps if self.trusted(s, now)), default=None)

    def protected(self, steps: list[int], now: int, final: bool = False) -> set[int]:
        """The checkpoints (by step) kept beyond the newest keep_last: anchor and candidate;
        none at the end of a run (`final`) whose last TRUST_STEPS steps had no anomaly."""
        if final and not any(a > now - TRUST_STEPS for a in self.anomalies):
            return set()
        anchor = self._anchor(steps, now)
        later = [s for s in steps if anchor is None or s > anchor]
        return {s for s in (anchor, min(later, default=None)) if s is not None}

    def resume_point(self, steps: list[int], now: int) -> int | None:
        """The checkpoint a diverged run continues from (None: there is none)."""
        anchor = self._anchor(steps, now)
        return anchor if anchor is not None else min(steps, default=None)
