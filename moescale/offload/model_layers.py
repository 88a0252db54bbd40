"""Which layers of a model the offload engine takes, and what their disk-tier files need.

`offloadable_layers(model, config)`: the model's MoE layers (or the ValueError that says why
there is nothing to offload); `expert_shard(moe)`: an expert-parallel layer's ExpertShard (its
SHARD capability), whose local experts the store then holds; `disk_bytes(...)`: the bytes of a
layer's record files, checked against the free space before any is written; `shifted(...)`:
an expert_init for a shard (local expert l is global expert start + l).

Deliberately not here: the engine and its construction (engine.py: build_engine).
"""

from __future__ import annotations

from torch import nn

from moescale.dispatch.protocol import SHARD, capabilities_of
from moescale.layers.moe import MoE
from moescale.offload.config import OffloadConfig
from moescale.offload.records import POS_GRAD
from moescale.offload.state_format import RecordGeometry, StateFormat


def shifted(expert_init, start: int):
    """expert_init for an EP shard: local expert e is global expert start + e."""
    def init(layer, e, layout):
        return expert_init(layer, start + e, layout)
    return init


def offloadable_layers(model: nn.Module, config: OffloadConfig) -> list[MoE]:
    """The model's MoE layers, or the ValueError that says why there is nothing to offload."""
    if config.tier == "device-only":
        raise ValueError("tier='device-only' keeps the experts resident on the device: there is "
                         "nothing to offload; give tier='host', 'pin', 'disk' or 'auto', or do "
                         "not call offload_moe")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError("offload_moe found no MoE layer in the model; build it with "
                         "moescale.MoE layers (or convert its FFNs first)")
    return moes


def disk_bytes(moe: MoE, shard, state: StateFormat) -> int:
    """Bytes of the disk tier's record files for this layer's (local) experts: the rows that
    persist (a file's gradient row is a sparse tail until accumulation spills it)."""
    experts = moe.experts if shard is None else shard.local
    num = experts.num_experts if shard is None else len(shard.expert_ids)
    numel = sum(p.numel() for p in experts.parameters()) // max(1, num)
    return RecordGeometry(state, numel).offsets[POS_GRAD] * num


def expert_shard(moe: MoE):
    """The layer's ExpertShard (its SHARD capability) when it is expert-parallel, else None.

    The store then holds this rank's L local experts (store expert l = global expert
    shard.expert_ids.start + l). Any exchange that calls the container works behind it: the
    static dispatcher calls forward_rows, the pipelined one chunk_runner (CHUNKED), and both
    scale the gradient (x 1/W in, x W out), so expert gradients reach the store at the mean
    scale with no parameter involved."""
    return moe.experts if SHARD in capabilities_of(moe.experts) else None
