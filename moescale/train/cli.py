"""`moescale train`: parse the options, pick the run directory, run the Trainer.

    moescale train                                   # the tiny MoE GPT on the built-in corpus
    moescale train --config run.toml --model.num_experts 32 --train.steps 2000
    moescale train --resume runs/20260101-120000     # continue exactly where it stopped
    moescale train --offload.tier host --offload.device_budget_experts 2   # experts in RAM
    torchrun --nproc-per-node 2 -m moescale train --parallel.ep_size 2      # experts split
    torchrun --nproc-per-node 2 -m moescale train --parallel.placement dynamic   # LPT per step

Options are `--section.name VALUE` (or `--section.name=VALUE`; hyphens in the name work too,
`--model.top-k`, the other subcommands' kebab style), converted by the type of the config
field; `--help` lists them all with their defaults. A user error raises ValueError, which
`moescale.cli` prints as one line with exit code 2. With `--resume RUN_DIR` the run's own
config.toml is the base, `--config` and overrides apply on top (e.g. more `--train.steps`).

Exit codes: 0 done; 2 a user error (one line naming the value; also an OS error during set-up,
and a run directory or disk-tier directory held by a live run); 3 training diverged
(`train.max_skips` steps in a row had a non-finite loss or gradient, or every step was skipped;
every checkpoint is finite, the line names the one to continue from); 1 the run directory's
disk went full or read-only mid-run, or a disk-tier read did not match the checksum of its write
(one line; what was written before is intact); 130 Ctrl-C
and 143 SIGTERM (a checkpoint is saved when a step was running; during set-up SIGTERM unwinds
every cleanup first).

This file only parses and routes; the loop is in trainer.py.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from moescale.offload.direct_io import CorruptReadError
from moescale.train.config import help_text, load_config, saved_tree

USAGE = """usage: moescale train [--config FILE.toml] [--resume RUN_DIR] [--section.option VALUE ...]

Trains a GPT MoE language model (default: the `tiny` size on the text of this machine's Python
standard library, about 5 minutes on 2 CPU cores) and writes a run directory: config.toml,
metrics.jsonl, checkpoints/, summary.json and report.png.

  --config FILE.toml   options as TOML tables ([model], [train], ...), overridden by the flags
  --resume RUN_DIR     continue a run from its newest valid checkpoint (same losses as if
                       never stopped); Ctrl-C saves a checkpoint and exits with code 130
  -h, --help           this text

Offloading: --offload.tier host|pin|disk|auto keeps expert state in RAM or on disk and streams
experts through a device budget (--offload.device_budget_bytes 64MiB or
--offload.device_budget_experts N; auto: the planner picks the mode for the budget). Expert parallelism: launch with
`torchrun --nproc-per-node N -m moescale train --parallel.ep_size N ...` (gloo on CPU, NCCL
on GPU); rank 0 prints and writes, checkpoints resume at any rank count. Both: add
--offload.tier host|pin|disk and each rank streams its own experts from its own store (disk:
<offload.directory or run_dir/expert-store>/rank<r>) through its device budget. Dynamic placement:
`torchrun --nproc-per-node N -m moescale train --parallel.placement dynamic ...` (CPU ranks of
one machine share one host copy of the experts in /dev/shm, placed by LPT every iteration;
--parallel.split false: no hot-expert splitting; several machines (torchrun --nnodes): a copy
per machine, gradients averaged across machines; --parallel.node_size N: nodes of N ranks);
every step logs the modelled max/mean device load (device_load_max_over_mean, static
placement's static_load_max_over_mean).

options (--section.option VALUE, or --section.option-name; 'none' unsets an optional value):"""


def parse_args(argv: list[str]) -> tuple[str | None, str | None, dict[str, str], bool]:
    """(config file, resume dir, dotted overrides, help?) from the argument list."""
    config_file = resume = None
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return None, None, {}, True
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --section.option "
                             "VALUE (see moescale train --help)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"option --{name} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            config_file = value
        elif name == "resume":
            resume = value
        elif "." in name:     # --model.top-k is --model.top_k (the other commands' style)
            section, _, option = name.partition(".")
            overrides[f"{section}.{option.replace('-', '_')}"] = value
        else:
            raise ValueError(f"unknown option --{name}; options are --config, --resume and "
                             "--section.option (see moescale train --help)")
    return config_file, resume, overrides, False


class Terminated(BaseException):
    """SIGTERM outside a training step (set-up, the summary): unwinds so that every cleanup
    runs (the offload engine's threads, the shared store's /dev/shm file), then exit 143."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def _os_error_text(err: OSError) -> str:
    """An OSError as '<reason> (<file>)', the reason as the system gives it."""
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err}{where}"


def new_run_dir(root: str | Path = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file, resume, overrides, want_help = parse_args(argv)
    if want_help:
        from moescale.models import gpt_config
        from moescale.train.config import ModelSection

        print(USAGE)
        print(help_text(gpt_config(ModelSection().size).to_flat()))
        return 0
    base = None
    if resume is not None:
        run_dir = Path(resume)
        base = saved_tree(run_dir, f"--resume {resume!r}")
        overrides["train.run_dir"] = str(run_dir)
    config = load_config(config_file, overrides, base=base)
    if resume is None:
        run_dir = Path(config.train.run_dir) if config.train.run_dir else new_run_dir()
    else:     # a moved run: its copy of a tokenizer whose original is gone
        from moescale.train.tokenizer import run_tokenizer_path

        config.data.tokenizer = run_tokenizer_path(config.data.tokenizer, run_dir)
    from moescale.train.guard import TrainingDiverged
    from moescale.train.trainer import Trainer

    previous = signal.signal(signal.SIGTERM, _raise_terminated) \
        if threading.current_thread() is threading.main_thread() else None
    group_before = dist.is_available() and dist.is_initialized()
    try:
        try:
            trainer = Trainer(config, run_dir, resume=resume is not None)
        except OSError as err:     # set-up: nothing ran, so there is nothing to resume
            raise ValueError(f"{_os_error_text(err)} while setting up the run (nothing was "
                             "trained); fix the path or its permissions") from None
        code = trainer.run()
        if not group_before and dist.is_available() and dist.is_initialized():
            # a torchrun rank tears its groups down before the interpreter does: gloo's threads
            # destroyed at exit while still joinable abort the process after a finished run
            dist.destroy_process_group()
        return code
    except KeyboardInterrupt:
        print("moescale train: aborted (no checkpoint saved for the current step)",
              file=sys.stderr)
        return 130
    except Terminated:
        print("moescale train: terminated (SIGTERM) outside a training step; no checkpoint "
              "saved for it, nothing left behind", file=sys.stderr)
        return 143
    except TrainingDiverged as err:
        print(f"moescale train: {err}", file=sys.stderr)
        return 3
    except CorruptReadError as err:     # a disk-tier file changed under the run
        print(f"moescale train: error: {err.strerror}; nothing read from it was trained on or "
              f"saved: continue from the newest checkpoint with --resume {run_dir}",
              file=sys.stderr)
        return 1
    except OSError as err:          # disk full or read-only mid-run: one line, data intact
        print(f"moescale train: error: {_os_error_text(err)}; what the run wrote before "
              f"is intact: free disk space or fix permissions, then continue with --resume "
              f"{run_dir}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
