"""The ExpertStore's plain types and set-up checks: the layout of an expert's parameters, the
store's config, one expert's record as its rows, the disk directory's checks and the default
host cache (store.py re-exports them).

Deliberately not here: the store itself (store.py).

Legend: E experts of a layer, P parameters of one expert.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Sequence

import torch

from moescale.offload import records
from moescale.offload.state_format import StateFormat
from moescale.sizes import fmt_bytes

MASTER, GRAD, EXP_AVG, EXP_AVG_SQ = 0, 1, 2, 3
# where each of those rows sits in a disk-tier record file / slot
LOGICAL_POS = (records.POS_MASTER, records.POS_GRAD, records.POS_EXP_AVG,
               records.POS_EXP_AVG_SQ)
TIERS = ("host", "disk")
Key = tuple[int, int]


class ExpertLayout:
    """The tensors of one expert (name -> shape), flattened in order into P fp32 numbers."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.names = [n for n, _ in shapes]
        self.shapes = [tuple(s) for _, s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)

    def split(self, flat_P: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a flat [P] tensor as the expert's named tensors."""
        return {n: part.view(shape) for n, shape, part in
                zip(self.names, self.shapes, torch.split(flat_P, self.sizes))}

    def record_bytes(self, fmt: StateFormat | None = None) -> int:
        """Bytes of one expert's record: fp32 master, gradient and moments (16 P), or in
        `fmt` (unpadded rows)."""
        if fmt is None:
            return 4 * self.numel * 4
        return sum(fmt.row_bytes(pos, self.numel) for pos in range(4))


@dataclass(kw_only=True)
class StoreConfig:
    """Where expert state lives. host_cache_bytes bounds the disk tier's RAM cache (None: an
    eighth of the expert state, at most a quarter of the available RAM, at least 2 records)."""

    tier: str = "host"
    directory: str | None = None
    host_cache_bytes: int | None = None
    pin_memory: bool = False
    shared_memory: bool = False
    io_threads: int = 4
    direct_io: bool = True    # False: buffered I/O + posix_fadvise(DONTNEED) (as on tmpfs)
    verify_reads: bool = True   # disk tier: check every read against the sums of its write
    state: StateFormat = StateFormat()   # master and moment formats of the records
    reserve_disk: bool = True  # check free space for every record file (False: none written)

    def __post_init__(self) -> None:
        if not self.state.exact and self.shared_memory:
            raise ValueError(f"a store shared between processes holds fp32 records only, not "
                             f"{self.state.name}; use master='fp32', moments='fp32' with "
                             "shared_memory (dynamic placement)")
        if self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r} is unknown; use one of {', '.join(TIERS)}")
        if self.tier == "disk":
            if self.directory is None:
                raise ValueError("tier='disk' needs directory=<an existing writable directory "
                                 "for the expert files>")
            if self.host_cache_bytes is not None and self.host_cache_bytes < 1:
                raise ValueError(f"host_cache_bytes={self.host_cache_bytes!r}: the disk tier "
                                 "needs a positive host cache size in bytes (e.g. 1 << 30), "
                                 "or None for the default")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads!r} must be >= 1")


class ExpertRecord:
    """One expert's state: rows MASTER, GRAD, EXP_AVG, EXP_AVG_SQ; step_t; on the host tier
    also `data_4P`, the [4, P] view of the rows (fp32 records only). With fp32 state every row
    is an fp32 [P] view; otherwise each is what the store's StateFormat keeps (a bf16 [P]
    master or moment, an int8 moment's raw uint8 row; the gradient is always fp32, and on a
    compact host store None unless the access asked for it)."""

    def __init__(self, key: Key, rows: Sequence[torch.Tensor], step_t: torch.Tensor,
                 data_4P: torch.Tensor | None = None) -> None:
        self.key, self.rows, self.step_t, self.data_4P = key, list(rows), step_t, data_4P

    @property
    def master_P(self) -> torch.Tensor:
        return self.rows[MASTER]

    @property
    def grad_P(self) -> torch.Tensor:
        return self.rows[GRAD]

    @property
    def exp_avg_P(self) -> torch.Tensor:
        return self.rows[EXP_AVG]

    @property
    def exp_avg_sq_P(self) -> torch.Tensor:
        return self.rows[EXP_AVG_SQ]


def check_directory(directory: str, need_bytes: int) -> None:
    """Raise a clear error unless `directory` exists, is writable and has need_bytes free.
    The probe is a fresh unnamed file (O_EXCL: it never follows or truncates a symlink)."""
    if not os.path.exists(directory):
        raise ValueError(f"directory={directory!r} does not exist; create it (mkdir -p) or "
                         "point the disk tier at an existing directory")
    if not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r} is not a directory; give a directory for "
                         "the expert files")
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".moescale-probe-") as f:
            f.write(b"0")
            f.flush()
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"the disk under {directory!r} is full; free space or "
                          "choose another directory for the disk tier") from err
        raise ValueError(f"directory={directory!r} is not writable ({err.strerror}); choose a "
                         "writable directory for the disk tier") from err
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"the disk tier needs {fmt_bytes(need_bytes, exact=True)} "
                      f"under {directory!r} but only {fmt_bytes(free, exact=True)} are free; "
                      "free space or choose another directory")


def default_host_cache(record_bytes: int, total_bytes: int) -> int:
    """The disk tier's host cache when none is given: an eighth of the expert state, at most a
    quarter of the RAM available now, at least two records."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = total_bytes
    return max(2 * record_bytes, min(total_bytes // 8, available // 4))
