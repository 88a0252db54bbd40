"""One call to make a model expert-parallel: groups from the environment, shards, dispatchers.

`setup_expert_parallel(model, config)` initializes torch.distributed from torchrun's
environment (or reuses an initialized default group), builds the EP/DP groups, and replaces
every MoE of `model` by its shard with the dispatcher the config asks for: the plain
`ExpertParallelDispatcher` for chunks=1 and reuse="none", else the
`PipelinedExpertParallelDispatcher` (chunks int or "auto", reuse none/S1-S4/"auto").

The model must be identical on every rank before the call (same seed or checkpoint). This does
not shard data, wrap DDP, or decide which rank writes files: the training loop does.
"""

from __future__ import annotations

from torch import nn

from moescale.parallel.expert_parallel import expert_parallel_model
from moescale.parallel.groups import ParallelConfig, ParallelGroups, init_distributed
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher


def dispatcher_factory(groups: ParallelGroups, config: ParallelConfig):
    """None (the static dispatcher) or a factory of pipelined dispatchers, per the config."""
    if config.chunks == 1 and config.reuse == "none":
        return None

    def make(moe):
        return PipelinedExpertParallelDispatcher(
            groups, moe.num_experts, num_chunks=config.chunks, strategy=config.reuse,
            memory_limit_bytes=config.memory_limit_bytes)
    return make


def setup_expert_parallel(model: nn.Module, config: ParallelConfig) -> ParallelGroups:
    """Shard `model`'s MoE layers over the EP group (in place); returns the groups."""
    groups = init_distributed(config)
    expert_parallel_model(model, groups, dispatcher_factory(groups, config))
    return groups
