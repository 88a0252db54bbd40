"""`ExpertShard`: the slice of a layer's experts one expert-parallel rank holds.

Rank r of W holds experts [r*L, (r+1)*L) of E as `local`, any expert container with L experts
(stacked, module, offloaded); its parameters are tagged as expert parameters (DDP/FSDP skip
them, gradient synchronization treats them as shards). `num_experts` is the layer's total E
(so `MoE` accepts the shard), `expert_ids` the global ids held. The shard passes the local
container's capabilities on (see moescale.dispatch.protocol), except the local dispatcher's
ROUTED path: a shard only makes sense behind an exchange. Swapping `local` (offload_moe does)
changes the capabilities with it.

Deliberately not here: how experts are split over ranks and the exchanges
(moescale.parallel.expert_parallel); nothing here communicates.

Legend: R rows grouped by local expert, N rows of one expert, D model width.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from moescale.dispatch.protocol import ROUTED, SHARD, capabilities_of

EXPERT_ATTR = "moescale_expert"   # set to True on parameters that are sharded experts


def mark_expert_parameters(module: nn.Module) -> nn.Module:
    """Tag every parameter of `module` as an expert parameter (DDP/FSDP must skip them)."""
    for p in module.parameters():
        setattr(p, EXPERT_ATTR, True)
    return module


def is_expert_parameter(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_ATTR, False))


class ExpertShard(nn.Module):
    """The L experts this rank owns out of E: `local` is any expert container of L experts.

    `num_experts` is the layer's total E (so `MoE` accepts it); `expert_ids` the global ids held.
    """

    def __init__(self, local: nn.Module, num_experts: int, expert_ids: range) -> None:
        super().__init__()
        capabilities_of(local)
        if local.num_experts != len(expert_ids):
            raise ValueError(f"the local experts hold {local.num_experts} experts but this "
                             f"rank owns {len(expert_ids)} ({expert_ids}); build the local "
                             "container with one expert per owned id")
        self.local = mark_expert_parameters(local)
        self.num_experts = num_experts
        self._expert_ids = expert_ids

    @property
    def expert_ids(self) -> range:
        return self._expert_ids

    @property
    def capabilities(self) -> frozenset[str]:
        return (self.local.capabilities - {ROUTED}) | {SHARD}

    @property
    def num_local_experts(self) -> int:
        return len(self._expert_ids)

    def forward_rows(self, x_RD: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        assert len(counts) == self.num_local_experts, (len(counts), self._expert_ids)
        return self.local.forward_rows(x_RD, counts)

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Global expert e (must be held here)."""
        return self.local.expert_forward(e - self._expert_ids.start, x_ND)

    def state_access(self, key: str, optimizer=None, engine=None):
        """STATE_ACCESS (when the local container has it): the local experts' state, local index l
        = global expert expert_ids.start + l."""
        return self.local.state_access(key, optimizer, engine)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, holds={self._expert_ids}"
