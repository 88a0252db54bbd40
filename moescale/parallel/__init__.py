"""torch.distributed for MoE: process groups, the autograd all-to-all, static expert parallelism,
the pipelined all-to-all (reuse strategies, cost model, tuner), gradient synchronization,
portable state dicts, a local multi-process launcher, and dynamic placement's dispatcher (LPT
with hot-expert splitting; the node-shared expert stores it runs over are moescale.shared_store).
See docs/expert_parallel.md and docs/dynamic_placement.md.

Importing this package imports torch.distributed; `moescale.layers` and `moescale.routing`
never do.
"""

from moescale.parallel.all_to_all import (all_reduce_sum, all_to_all_rows,
                                          all_to_all_rows_async, exchange_counts,
                                          start_all_to_all)
from moescale.parallel.dynamic import (DynamicPlacementDispatcher, PlacementStats,
                                       load_model_config, placement_stats, sum_expert_grads)
from moescale.parallel.choices import PipelineChoice, pipeline_choices
from moescale.parallel.cost_model import LayerShape, Rates, choose_strategy, measure_rates
from moescale.parallel.expert_parallel import (ExpertParallelDispatcher, ExpertShard,
                                               expert_parallel_model, expert_parallel_moe,
                                               shard_moe)
from moescale.parallel.grad_sync import (allreduce_gradients, clip_grad_norm_,
                                         ddp_ignore_names, expert_parameters,
                                         global_mean_weight)
from moescale.parallel.groups import (ParallelConfig, ParallelGroups, build_groups,
                                      groups_from, init_distributed)
from moescale.parallel.launch import run_local
from moescale.parallel.placement import Placement, PlacementConfig, plan_placement
from moescale.parallel.pipeline import PipelinedAllToAll, PipelinedExpertParallelDispatcher
from moescale.parallel.setup import setup_expert_parallel
from moescale.parallel.state import full_state_dict, load_full_state_dict
from moescale.parallel.tuner import ChunkTuner, TunerConfig

__all__ = [
    "DynamicPlacementDispatcher", "Placement", "PlacementConfig", "PlacementStats",
    "load_model_config", "placement_stats", "plan_placement", "sum_expert_grads",
    "ChunkTuner", "ExpertParallelDispatcher", "ExpertShard", "LayerShape", "ParallelConfig",
    "ParallelGroups", "PipelineChoice", "PipelinedAllToAll", "PipelinedExpertParallelDispatcher",
    "Rates", "pipeline_choices",
    "TunerConfig", "all_reduce_sum", "all_to_all_rows", "all_to_all_rows_async",
    "allreduce_gradients", "build_groups", "choose_strategy", "clip_grad_norm_",
    "ddp_ignore_names", "exchange_counts", "expert_parallel_model", "expert_parallel_moe",
    "expert_parameters", "full_state_dict", "global_mean_weight", "groups_from",
    "init_distributed", "load_full_state_dict", "measure_rates", "run_local",
    "setup_expert_parallel", "shard_moe", "start_all_to_all",
]
