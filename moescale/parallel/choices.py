"""What the pipelined expert-parallel layers chose on their last call, as plain data.

`pipeline_choices(model)` maps each MoE layer of `model` that runs the pipelined dispatcher
(`PipelinedExpertParallelDispatcher`) and has been called at least once to a `PipelineChoice`:
its chunk count (fixed, or the tuner's pick under the memory limit) and its reuse strategy
(fixed, or the cost model's pick: "none", "S1".."S4", or "unpipelined" when the plain
dispatcher ran). A trainer logs it after a step, e.g. into metrics.jsonl:

    {name: list(choice) for name, choice in pipeline_choices(model).items()}

It reads the dispatchers' `last_stats`; it communicates nothing and changes nothing. The
choices are identical on every rank of an EP group (the tuner and the cost model see the
group's largest counts and the same measured times).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from moescale.layers.moe import MoE
from moescale.parallel.pipeline import PipelinedExpertParallelDispatcher

__all__ = ["PipelineChoice", "pipeline_choices"]


class PipelineChoice(NamedTuple):
    """One layer's last call: chunk count and strategy (a tuple: JSON-ready as a list)."""

    chunks: int
    strategy: str


def pipeline_choices(model: nn.Module) -> dict[str, PipelineChoice]:
    """{module name: PipelineChoice} for every pipelined MoE layer of `model` that has run
    ("" names `model` itself); layers not yet called, and other dispatchers, are left out."""
    choices = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoE) or \
                not isinstance(module.dispatcher, PipelinedExpertParallelDispatcher):
            continue
        stats = module.dispatcher.last_stats
        if "chunks" in stats and "strategy" in stats:
            choices[name] = PipelineChoice(int(stats["chunks"]), str(stats["strategy"]))
    return choices
