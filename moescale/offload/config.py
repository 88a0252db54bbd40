"""`OffloadConfig`: how a model's experts are offloaded (ES-MoE), as plain data.

The library's `offload_moe(model, OffloadConfig(...))` reads it, and the trainer's run config
nests it as its `[offload]` section (moescale/train/config.py), so the command line's
`--offload.tier disk --offload.device_budget_experts 3` are these fields. Each field's trailing
comment is its documentation (`moescale train --help` prints it). Sizes are `Size` (bytes, an
int; the command line parses '64MiB' once at its edge).

Validation here covers every field alone and the pairs that exclude each other; what needs the
model or the file system (a disk directory that exists, a budget of at least two experts) is
checked by `offload_moe` before it changes anything, as are the planner's inputs of tier "auto"
(a run derives the batch size from its own options).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moescale.offload.experts import POLICIES
from moescale.offload.optimizer import STEP_MODES, AdamWConfig
from moescale.offload.state_format import MASTERS, MOMENTS, StateFormat
from moescale.sizes import Size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Where expert state lives: "device-only" keeps the experts resident (nothing to offload; a
# run's default), "pin" is the host tier with the hottest experts pinned on the device, "auto"
# lets the planner pick among device-only / pin / host / disk for the budgets.
OFFLOAD_TIERS = ("device-only", "auto", "pin", "host", "disk")
PIN_DEFAULT = 0.25     # tier "pin": the share of experts pinned when pin_fraction is 0
PLANNER_RATES = ("measure", "a100")


@dataclass(kw_only=True)
class OffloadConfig:
    """Expert offloading (ES-MoE): where expert state lives and how much the device holds.

    Give the device budget in bytes or in experts (of the largest layer, in compute precision).
    A field's trailing comment is its documentation (the command line's --help shows it)."""

    tier: str = "host"                  # device-only | auto (the planner picks) | pin | host | disk
    directory: str | None = None        # disk tier: where the expert files go (the trainer:
                                        # <run_dir>/expert-store)
    host_cache_bytes: Size | None = None  # disk tier: bytes of expert records cached in RAM
                                          # (unset: 1/8 of the expert state, at least 2 experts)
    device: str = "auto"                # auto (cuda when present, else a simulated device) | cpu
                                        # | cuda
    device_budget_bytes: Size | None = None   # device bytes for experts, e.g. 64MiB
    device_budget_experts: float | None = None   # or the budget in experts (2: one expert and
                                                 # its gradient; 3: double-buffered uploads)
    compute_dtype: str = "float32"      # the experts' precision on the device
    activation_policy: str = "keep"     # expert hidden for backward: keep | recompute | offload
    step_mode: str = "eager"            # eager (each expert steps after its backward; needs no
                                        # global-norm clipping) | deferred (all at engine.step)
    lookahead: int = 1                  # experts uploaded ahead of the one computing
    pin_fraction: float = 0.0           # share of experts kept on the device, hottest first
                                        # (tier pin: 0.25 when left at 0)
    ema_decay: float = 0.9              # smoothing of the per-expert token counts that rank
                                        # experts by heat
    shared_memory: bool = False         # host tier: the store in /dev/shm (shared by processes)
    io_threads: int = 4                 # disk tier: concurrent record reads and writes
    verify_reads: bool = True           # disk tier: check every record read against the
                                        # checksums of its write (off: saves the hashing CPU)
    reserve_disk: bool = True           # disk tier: check at set-up that the disk holds every
                                        # record file (false: a store that adopts a checkpoint's
                                        # files and writes none, as generation's)
    optimizer: AdamWConfig | None = None   # the experts' AdamW (None: AdamW's defaults)
    tokens_per_micro_batch: int | None = None   # tier auto: the planner's batch size in tokens
    host_budget_bytes: Size | None = None   # tier auto: host bytes the planner may use (unset:
                                            # the available RAM)
    rates: str = "measure"              # tier auto: compute / copy / disk rates measured here,
                                        # or ES-MoE's A100 node ('a100')
    master: str = "fp32"                # the experts' master weights in the store: fp32 | bf16
                                        # (updated with stochastic rounding: half the bytes)
    moments: str = "fp32"               # the experts' Adam moments in the store: fp32 | bf16 |
                                        # int8 (block-wise dynamic quantisation: 1.02 bytes)
    seed: int = 0                       # the stochastic rounding of a bf16 master (a run's:
                                        # train.seed)

    def __post_init__(self) -> None:
        for name, choices in (("tier", OFFLOAD_TIERS), ("activation_policy", POLICIES),
                              ("step_mode", STEP_MODES), ("compute_dtype", DTYPES),
                              ("rates", PLANNER_RATES), ("master", MASTERS),
                              ("moments", MOMENTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; use one of "
                                 f"{', '.join(choices)}")
        if self.device_budget_bytes is not None and self.device_budget_experts is not None:
            raise ValueError(f"device_budget_experts={self.device_budget_experts!r}: give "
                             f"device_budget_bytes={self.device_budget_bytes!r} or a budget in "
                             "experts, not both")
        if self.device_budget_experts is not None and not self.device_budget_experts > 0:
            raise ValueError(f"device_budget_experts={self.device_budget_experts!r} must be > 0 "
                             "(at least 2: backward holds an expert and its gradient)")
        for name in ("device_budget_bytes", "host_budget_bytes", "host_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value >= 1):
                raise ValueError(f"{name}={value!r} must be a positive number of bytes (e.g. "
                                 "64 << 20), or None")
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead={self.lookahead!r} must be an integer >= 0")
        if not 0.0 <= self.pin_fraction <= 1.0:
            raise ValueError(f"pin_fraction={self.pin_fraction!r} must lie in [0, 1]")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay!r} must lie in [0, 1)")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads!r} must be >= 1")
        if not self.state.exact and self.tier == "device-only":
            raise ValueError(f"master={self.master!r}, moments={self.moments!r}: resident "
                             "experts keep fp32 state in torch's AdamW; compact state is for "
                             "offloaded experts (tier host, pin, disk or auto)")
        if not self.state.exact and self.shared_memory:
            raise ValueError(f"master={self.master!r}, moments={self.moments!r}: a store "
                             "shared between processes holds fp32 records only; use fp32 "
                             "master and moments with shared_memory")

    @property
    def state(self) -> StateFormat:
        """The store's record format (master and moments)."""
        return StateFormat(master=self.master, moments=self.moments, seed=self.seed)

    @property
    def store_tier(self) -> str:
        """The store's tier: 'host' for pin (and device-only), else the tier."""
        return "disk" if self.tier == "disk" else "host"

    @property
    def pinned_share(self) -> float:
        """The share of experts pinned on the device (tier pin: at least PIN_DEFAULT)."""
        return self.pin_fraction or (PIN_DEFAULT if self.tier == "pin" else 0.0)
