"""offload_moe(model, OffloadConfig(...)): the offload package's entry point.

A concrete tier (host, pin, disk) goes straight to the engine (engine.py: build_engine).
`OffloadConfig(tier="auto", tokens_per_micro_batch=..., device_budget_bytes=...)` first asks the
planner for the mode (auto.py: resolve_auto) and hands the engine the concrete config it maps
to; `engine.plan` then holds the planner's estimates and pick. Resolving `auto` here, above
the engine, keeps the planner (which measures an offloaded layer: rates.py) out of the engine's
imports: engine <- rates <- planner <- auto <- entry, no circle.

Deliberately not here: the engine itself, the planner's model.
"""

from __future__ import annotations

from torch import nn

from moescale.offload.auto import resolve_auto
from moescale.offload.config import OffloadConfig
from moescale.offload.engine import OffloadEngine, build_engine
from moescale.offload.model_layers import expert_shard, offloadable_layers


def offload_moe(model: nn.Module, config: OffloadConfig | None = None, *,
                expert_init=None) -> OffloadEngine:
    """Move the experts of every MoE layer of `model` into an ExpertStore (in place).

    expert_init(layer, expert, layout) -> flat fp32 [layout.numel], if given, initialises the
    store instead of the experts' own weights: models built on the meta device never hold
    their experts in memory (grouped experts only; `expert` is the global id, also for
    expert-parallel layers). `model.state_dict()` afterwards warns that the experts are not in
    it (moescale.models.resident: consolidated_state_dict / resident_model give them back)."""
    config = config or OffloadConfig()
    moes = offloadable_layers(model, config)
    planned = None
    if config.tier == "auto":
        if config.tokens_per_micro_batch is None or config.device_budget_bytes is None:
            raise ValueError("tier='auto' needs tokens_per_micro_batch=<tokens per "
                             "micro-batch> and device_budget_bytes=<device memory for "
                             "training>, the planner's inputs")
        if any(expert_shard(m) is not None for m in moes):
            raise ValueError("tier='auto' plans one process's experts; this model is "
                             "expert-parallel (ExpertShard layers): give tier='host' or "
                             "'disk' and a device budget per rank")
        config, estimates, pick = resolve_auto(model, config)
        planned = (estimates, pick)
    engine = build_engine(model, config, expert_init=expert_init)
    engine.plan = planned  # (the planner's estimates, its pick) when tier was 'auto'
    return engine
