"""The processes of a training run: one, or the ranks of a torch.distributed world.

`make_ranks()` picks by world size: `OneProcess` (every reduction is the identity) when the run
is one process, `WorldRanks` when torchrun's environment (WORLD_SIZE > 1) or an initialised
process group says there are several. Both answer the same questions for the trainer: who am
I (`rank`, `world_size`, `writer` = rank 0, the only one that writes files and prints), which
rows of a batch are mine (`shard`: an equal slice of the rows, so the global batch and the mean
loss are the single-process ones), and the small reductions the loop needs (`mean`,
`sum_counts`, `any`, `agree`, `barrier`). They know nothing of experts: the exchange and the
residency of the experts (moescale/train/assembly.py) build their own groups.

Legend: B batch rows, S sequence.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moescale.parallel.all_to_all import collective_errors
from moescale.parallel.groups import ParallelConfig, init_default_group


def world_size_of_launch() -> int:
    """The world size this process was launched into (1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_rows(batch_size: int, world: int) -> None:
    """Each of the `world` ranks takes an equal slice of a batch's rows."""
    if batch_size % world:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by the {world} "
                         "ranks; each rank takes an equal slice of the rows")


class OneProcess:
    """A run on one process: every reduction is the identity."""

    rank, world_size, writer = 0, 1, True
    device = torch.device("cpu")

    def shard(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor):
        return idx_BS, targets_BS

    def mean(self, values: list[float]) -> list[float]:
        return values

    def sum_counts(self, counts: list[torch.Tensor]) -> list[torch.Tensor]:
        return counts

    def any(self, flag: bool) -> bool:
        return flag

    def agree(self, value):
        return value

    def barrier(self) -> None:
        pass

    def gather_objects(self, value) -> list:
        return [value]


class WorldRanks:
    """The ranks of the default torch.distributed process group (initialised from torchrun's
    environment when it is not yet: gloo without CUDA, NCCL with it)."""

    def __init__(self, timeout_s: float, backend: str = "auto") -> None:
        init_default_group(ParallelConfig(backend=backend, timeout_s=timeout_s),
                           "`torchrun --nproc-per-node N -m moescale train ...` (or "
                           "moescale.train.launch.train_distributed)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.writer = self.rank == 0
        self.device = torch.device("cpu") if dist.get_backend() == "gloo" else \
            torch.device("cuda", torch.cuda.current_device())

    def shard(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor):
        rows = idx_BS.shape[0] // self.world_size
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        return idx_BS[mine], targets_BS[mine]

    def all_reduce(self, t: torch.Tensor, op=None, group=None,
                   what: str = "training-metrics all-reduce") -> torch.Tensor:
        """`t` reduced (sum, or `op`) over `group` (None: the world), back on the CPU."""
        moved = t.to(self.device)
        with collective_errors(what, group):
            dist.all_reduce(moved, op=op or dist.ReduceOp.SUM, group=group)
        return moved.cpu()

    def mean(self, values: list[float]) -> list[float]:
        total = self.all_reduce(torch.tensor(values, dtype=torch.float64))
        return [v / self.world_size for v in total.tolist()]

    def sum_counts(self, counts: list[torch.Tensor]) -> list[torch.Tensor]:
        if not counts:
            return counts
        flat = self.all_reduce(torch.cat([c.reshape(-1) for c in counts]))
        return list(flat.split([c.numel() for c in counts]))

    def any(self, flag: bool) -> bool:
        return bool(self.all_reduce(torch.tensor([int(flag)]))[0])

    def agree(self, value):
        """Rank 0's `value` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1), what="barrier")

    def gather_objects(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        every = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every


def make_ranks(timeout_s: float = 300.0, backend: str = "auto"):
    """`OneProcess` for a one-process run, else `WorldRanks` (see the module docstring)."""
    return OneProcess() if world_size_of_launch() == 1 else WorldRanks(timeout_s, backend)
