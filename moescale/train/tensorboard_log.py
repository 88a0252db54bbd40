"""TensorBoard event files of a run (`--train.tensorboard`): the metrics records as scalars.

`ScalarLog(log_dir, purge_step)` writes each train record's loss, aux loss, lr, tokens/s,
grad norm, expert imbalance and wait_s (and the modelled device load when logged) and each
val record's loss through `torch.utils.tensorboard.SummaryWriter`, at the record's step.
`purge_step`: a resumed run's first redone step; TensorBoard then drops the events at and past
it that the interrupted run had written, as metrics.jsonl drops its lines. Needs the optional
`tensorboard` package (`pip install tensorboard`, or the `tensorboard` extra); without it
`require_tensorboard()` raises ValueError naming the option and the install command.

Not here: what the numbers mean (metrics.py), which rank writes (the trainer: rank 0 only).
"""

from __future__ import annotations

import importlib
from pathlib import Path

# record key -> tag
TRAIN_TAGS = {"loss": "train/loss", "aux_loss": "train/aux_loss", "lr": "train/lr",
              "tokens_per_s": "train/tokens_per_s", "grad_norm": "train/grad_norm",
              "imbalance": "train/imbalance", "wait_s": "train/wait_s",
              "device_load_max_over_mean": "train/device_load_max_over_mean"}
VAL_TAGS = {"val_loss": "val/loss"}


def require_tensorboard() -> None:
    """ValueError unless the tensorboard package is importable."""
    try:
        importlib.import_module("tensorboard")
    except ImportError:
        raise ValueError("train.tensorboard=true needs the tensorboard package, which is not "
                         "installed: pip install tensorboard (or pip install "
                         "'moescale[tensorboard]'), or leave train.tensorboard false") from None


class ScalarLog:
    """A SummaryWriter over `log_dir` fed with metrics records (see the module docstring)."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=10)

    def write(self, record: dict) -> None:
        tags = {"train": TRAIN_TAGS, "val": VAL_TAGS}.get(record.get("kind"), {})
        for key, tag in tags.items():
            value = record.get(key)
            if value is not None:
                self.writer.add_scalar(tag, float(value), record["step"])

    def close(self) -> None:
        self.writer.close()
