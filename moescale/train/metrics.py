"""metrics.jsonl: one JSON object per line, per training step, validation pass and summary.

Records carry `kind` ("train", "val" or "summary") and `step` (optimizer steps completed).
A train record holds loss (cross-entropy), aux_loss, lr, grad_norm, tokens, tokens_per_s,
elapsed_s, wait_s (seconds the step's compute waited for offloaded experts: uploads, their
optimizer fences and disk reads, measured where they block (offload/cache.py); 0.0 for
resident experts; the ranks' mean), imbalance (max over MoE layers of max/mean tokens per
expert) and tokens_per_expert (a list per MoE layer of routed tokens per expert, summed over
the step's micro-batches); with several devices also the modelled device load in rows, summed over the
step's MoE calls: device_load_max, device_load_mean, device_load_max_over_mean (expert
parallelism: static placement; dynamic placement: its placement, plus device_load_worst_layer,
split_experts and static placement's static_load_max/mean/max_over_mean for comparison); with
the pipelined all-to-all `pipeline`, {layer: [chunks, strategy]} of each layer's last call
(the tuner's and the cost model's picks under `parallel.memory_limit_bytes`). A val
record holds val_loss. Lines are flushed as they are written, so a killed
run keeps everything logged so far; `truncate_after(step)` drops what a resumed run will redo.
With `tensorboard=True` the records also go to TensorBoard event files in the run directory's
tensorboard/ (tensorboard_log.py; a resumed run purges the events past its step).

This file formats and stores numbers; it computes none of them.
"""

from __future__ import annotations

import json
from pathlib import Path

from moescale.atomic import atomic_write_text
from moescale.train.tensorboard_log import ScalarLog, require_tensorboard


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl (a torn last line, from a kill mid-write, is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():   # garbage: skipped
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsLog:
    """Appends records to metrics.jsonl in the run directory."""

    def __init__(self, path: str | Path, enabled: bool = True,
                 tensorboard: bool = False) -> None:
        self.path = Path(path)
        self.enabled = enabled     # False on the ranks that do not write files
        self._file = None
        if tensorboard:
            require_tensorboard()     # on every rank: all of them refuse together
        self.tensorboard_dir = self.path.parent / "tensorboard" if tensorboard else None
        self._scalars = None
        self._purge_step = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tensorboard_dir is not None:
            if self._scalars is None:
                self._scalars = ScalarLog(self.tensorboard_dir, self._purge_step)
                self._purge_step = None
            self._scalars.write(record)

    def truncate_after(self, step: int) -> None:
        """Keep only train/val records with step <= `step` (rewritten atomically)."""
        self.close()
        if not self.enabled:
            return
        self._purge_step = step + 1 if step > 0 else None
        kept = [r for r in read_metrics(self.path)
                if r.get("kind") in ("train", "val") and r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None
