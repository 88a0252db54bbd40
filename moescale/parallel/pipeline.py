"""The pipelined expert-parallel dispatcher (MPipeMoE): static EP through a chunked, overlapped
all-to-all with memory reuse, its chunk count tuned online and its strategy chosen by a cost
model.

The pieces live beside it:

  pipeline_schedule.py  the chunk schedule of both directions, receive slots, combine fused in;
                        `PipelineSpec`
  pipeline_grouped.py   `PipelinedAllToAll` over grouped FFN/GLU experts (strategies none, S1-S4)
  pipeline_modules.py   `PipelinedRowsAllToAll` over any expert container (none, S2, S4)
  cost_model.py         per-rank peak memory and step time per strategy; `choose_strategy`
  tuner.py              the online chunk-count tuner

The chunk cuts inside every (peer, expert) bin are moescale.dispatch.chunk_layout's (host
arithmetic, no process group).

This file only decides, per call: the counts exchange (which also carries each rank's row count
and last measured time for the tuner), the chunk count, the strategy, and which Function runs.
The Function returns y_TD already combined (score-weighted sum per token), so the dispatcher
does not call `combine_rows`.

Legend: T tokens, R rows sent (grouped by global expert), D model width, W ranks of the EP
group, L experts per rank.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping

import torch

from moescale.dispatch.chunk_layout import chunk_layouts
from moescale.dispatch.plan import RoutingPlan
from moescale.dispatch.protocol import (CHUNKED, FFN_SHAPE, GROUPED_WEIGHTS, SHARD,
                                        AutogradChunkRunner, capabilities_of)
from moescale.layers.expert_threads import num_expert_workers
from moescale.layers.experts import compute_dtype
from moescale.layers.grouped_ffn import work_dtype
from moescale.parallel.all_to_all import exchange_counts
from moescale.parallel.cost_model import STRATEGIES, LayerShape, Rates, choose_strategy, \
    measure_rates
from moescale.parallel.expert_parallel import ExpertParallelDispatcher
from moescale.parallel.groups import ParallelGroups
from moescale.parallel.memory_model import STRATEGY_NAMES, chunks_that_fit
from moescale.parallel.pipeline_grouped import PipelinedAllToAll, run_grouped_pipeline
from moescale.parallel.pipeline_modules import (MODULE_STRATEGIES, PipelinedRowsAllToAll,
                                                check_rows_strategy)
from moescale.parallel.pipeline_schedule import PipelineSpec, elapsed, mark
from moescale.parallel.tuner import ChunkTuner, TunerConfig, bucket_of

__all__ = ["PipelineSpec", "PipelinedAllToAll", "PipelinedExpertParallelDispatcher",
           "run_grouped_pipeline"]


class PipelinedExpertParallelDispatcher(ExpertParallelDispatcher):
    """Static EP through `PipelinedAllToAll` with `num_chunks` chunks (an int, or "auto" for the
    online tuner) and reuse `strategy`.

    The shard's container is chosen by capability (moescale.dispatch.protocol): GROUPED_WEIGHTS
    (resident stacked experts) runs the grouped FFN kernels per chunk (all strategies); any
    other container goes through `PipelinedRowsAllToAll` (strategies none, S2, S4), run by its
    own ChunkRunner when it declares CHUNKED (offloaded experts: uploads overlapped across the
    chunks, eager steps after an expert's last chunk) or by `AutogradChunkRunner`.

    The counts exchange also
    carries each rank's row and token counts and its last measured forward+backward time, so
    the tuner and the cost model see the same numbers on every rank.

    strategy="auto": the cost model's pick per call (`choose_strategy`): the fastest predicted
    strategy whose per-rank peak is at most the unpipelined dispatcher's and at most
    `memory_limit_bytes` (the layer step's peak, weight gradients included), or the
    unpipelined dispatcher itself when no strategy is. `peaks` ({chunks: {strategy or
    "unpipelined": bytes}}, e.g. from `moescale bench ep-memory`) replaces the formulas.
    num_chunks="auto" under `memory_limit_bytes` (grouped experts): the tuner only tries chunk
    counts at which something fits (`chunks_for`), more than its candidates when needed.
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, *,
                 num_chunks: int | str = 2, strategy: str = "none",
                 tuner: TunerConfig | None = None, memory_limit_bytes: float | None = None,
                 rates: Rates | None = None,
                 peaks: Mapping[int, Mapping[str, float]] | None = None) -> None:
        super().__init__(groups, num_experts)
        if num_chunks != "auto" and (not isinstance(num_chunks, int) or num_chunks < 1):
            raise ValueError(f"num_chunks={num_chunks!r} must be a positive integer or 'auto'")
        if strategy != "auto" and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is unknown; use 'auto' or one of "
                             f"{', '.join(STRATEGIES)}")
        self.num_chunks, self.strategy = num_chunks, strategy
        self.memory_limit_bytes, self.rates = memory_limit_bytes, rates
        self.peaks = peaks               # {chunks: {strategy or "unpipelined": bytes}}
        self.tuner = ChunkTuner(tuner or TunerConfig()) if num_chunks == "auto" else None
        self.last_stats: dict = {}
        # (bucket, chunks) of the last calls (bounded: a long run makes millions of calls)
        self.history: deque[tuple[int, int]] = deque(maxlen=4096)

    def layer_shape(self, max_tokens: int, max_rows: int, local,
                    x_TD: torch.Tensor) -> LayerShape:
        """The call as the cost model sees it, identical on every rank: the group's largest
        token and row counts (a rank receives about what it sends under balanced routing).
        `local` declares FFN_SHAPE (d_model, d_ff, glu, bias)."""
        workers = num_expert_workers(x_TD.device, [1] * local.num_experts)
        return LayerShape(rows=max_rows, rows_sent=max_rows, tokens=max_tokens,
                          d_model=local.d_model, d_ff=local.d_ff, glu=local.glu,
                          bias=local.bias, elem_bytes=x_TD.element_size(),
                          work_bytes=torch.empty((), dtype=work_dtype(x_TD)).element_size(),
                          ep_size=self.groups.ep_size, num_local_experts=self.num_local,
                          host_is_device=x_TD.device.type == "cpu", workers=max(1, workers))

    def strategy_for(self, max_tokens: int, max_rows: int, chunks: int, local,
                     x_TD: torch.Tensor) -> tuple[str, list[dict] | None]:
        """The reuse strategy of this call and the cost model's table (None when fixed): the
        strategy given, or the cost model's pick, "unpipelined" included (identical on every
        rank: measured rates are maxed over the group, the shape is the group's largest),
        among the strategies the container supports (none/S2/S4 without GROUPED_WEIGHTS)."""
        if self.strategy != "auto":
            return self.strategy, None
        if self.rates is None:
            self.rates = measure_rates(self.groups, d_model=local.d_model, d_ff=local.d_ff,
                                       rows=max(64, max_rows), device=x_TD.device,
                                       dtype=x_TD.dtype)
        shape = self.layer_shape(max_tokens, max_rows, local, x_TD)
        peaks = None if self.peaks is None else self.peaks.get(chunks)
        candidates = STRATEGY_NAMES if GROUPED_WEIGHTS in local.capabilities else \
            MODULE_STRATEGIES
        return choose_strategy(shape, self.rates, chunks, self.memory_limit_bytes,
                               candidates=candidates, peaks=peaks)

    def chunks_for(self, bucket: int, max_tokens: int, max_rows: int, local,
                   x_TD: torch.Tensor) -> int:
        """The chunk count of this call: the one given, or the tuner's pick among the counts
        at which some strategy (the given one, or any and the unpipelined dispatcher for
        "auto") fits `memory_limit_bytes` (`chunks_that_fit`: more chunks than the tuner's
        candidates when none of them fits), among the strategies the container supports.
        Containers without FFN_SHAPE (module experts): the limit is not applied."""
        if self.tuner is None:
            return self.num_chunks
        if self.memory_limit_bytes is None or FFN_SHAPE not in local.capabilities:
            return self.tuner.choose(bucket)
        auto = self.strategy == "auto"
        supported = STRATEGY_NAMES if GROUPED_WEIGHTS in local.capabilities else \
            MODULE_STRATEGIES
        allowed = chunks_that_fit(self.layer_shape(max_tokens, max_rows, local, x_TD),
                                  self.memory_limit_bytes, self.tuner.config.candidates,
                                  supported if auto else (self.strategy,), plain=auto,
                                  peaks=self.peaks)
        return self.tuner.choose(bucket, allowed)

    def spec(self, plan: RoutingPlan, send_WL, recv_WL, chunks: int,
             strategy: str) -> PipelineSpec:
        """The chunk layouts and settings of one call (send/recv counts from `_exchange`)."""
        layouts = chunk_layouts(send_WL, recv_WL, plan.token_idx_R, chunks, self.groups.ep_rank)
        return PipelineSpec(layouts=layouts, groups=self.groups, strategy=strategy,
                            num_rows=plan.num_rows, grad_scale=1.0 / self.groups.ep_size)

    def _exchange(self, plan: RoutingPlan, device):
        """Counts exchange carrying [counts of the peer's experts..., my rows, my last time, my
        tokens]; returns (send_WL, recv_WL, the group's largest row and token counts)."""
        if len(plan.counts) != self.num_experts:
            raise ValueError(f"the routing plan has {len(plan.counts)} experts but the "
                             f"dispatcher was built for num_experts={self.num_experts}")
        W, L = self.groups.ep_size, self.num_local
        prev = self.last_stats
        elapsed_us = -1
        if "backward_marks" in prev and "forward_marks" in prev:
            fwd = elapsed(*prev["forward_marks"])
            bwd = elapsed(*prev["backward_marks"])
            if fwd is not None and bwd is not None:
                prev["forward_s"], prev["backward_s"] = fwd, bwd
                elapsed_us = int(1e6 * (fwd + bwd))
        send = [list(plan.counts[p * L:(p + 1) * L]) +
                [plan.num_rows, elapsed_us, plan.num_tokens] for p in range(W)]
        recv = exchange_counts(torch.tensor(send, dtype=torch.int64, device=device),
                               self.groups.ep_group).tolist()
        times = [row[L + 1] for row in recv]
        if self.tuner is not None and prev and min(times) >= 0:
            self.tuner.record(prev["bucket"], prev["chunks"], max(times) / 1e6)
        max_rows, max_tokens = max(row[L] for row in recv), max(row[L + 2] for row in recv)
        return [row[:L] for row in send], [row[:L] for row in recv], max_rows, max_tokens

    def __call__(self, x_TD: torch.Tensor, plan: RoutingPlan, experts) -> torch.Tensor:
        if SHARD not in capabilities_of(experts):
            raise ValueError("the pipelined expert-parallel dispatcher needs an ExpertShard "
                             f"(see shard_moe / expert_parallel_moe), got {type(experts).__name__}")
        if experts.num_local_experts != self.num_local:
            raise ValueError(f"the layer's experts hold {experts.num_local_experts} experts on "
                             f"this rank but the dispatcher expects {self.num_local}")
        local, caps = experts.local, experts.capabilities
        grouped = GROUPED_WEIGHTS in caps
        if self.strategy == "auto" and FFN_SHAPE not in caps:
            raise ValueError("strategy='auto' needs FFN-shaped experts (the cost model reads "
                             f"d_model, d_ff, glu, bias; {type(local).__name__} has no FFN "
                             "shape); give these experts strategy none, S2 or S4")
        if not grouped and self.strategy != "auto":
            check_rows_strategy(self.strategy)
        start = mark(x_TD)
        send_WL, recv_WL, max_rows, max_tokens = self._exchange(plan, x_TD.device)
        bucket = bucket_of(max_rows)
        x_TD = x_TD.to(compute_dtype(x_TD))
        chunks = self.chunks_for(bucket, max_tokens, max_rows, local, x_TD)
        self.history.append((bucket, chunks))
        strategy, table = self.strategy_for(max_tokens, max_rows, chunks, local, x_TD)
        if strategy == "unpipelined":
            self.last_stats = dict(bucket=bucket, chunks=chunks, strategy=strategy,
                                   strategy_table=table)
            return self._unpipelined(x_TD, plan, experts, self.last_stats, start)
        spec = self.spec(plan, send_WL, recv_WL, chunks, strategy)
        spec.stats.update(bucket=bucket, chunks=chunks, strategy=strategy, strategy_table=table)
        self.last_stats = spec.stats
        if grouped:
            y_TD = run_grouped_pipeline(x_TD, plan.scores_R, spec, local)
        else:
            counts = [lay.local_counts for lay in spec.layouts]
            runner = local.chunk_runner(counts, spec.grad_scale, x_TD) if CHUNKED in caps \
                else AutogradChunkRunner(local, counts, spec.grad_scale, x_TD)
            y_TD = PipelinedRowsAllToAll.apply(x_TD.contiguous(), plan.scores_R, spec, runner,
                                               *runner.autograd_inputs())
        spec.stats["forward_marks"] = (start, mark(x_TD))
        return y_TD

    def _unpipelined(self, x_TD: torch.Tensor, plan: RoutingPlan, experts, stats: dict,
                     start) -> torch.Tensor:
        """The plain dispatcher (the cost model found it leanest or fastest); hooks mark this
        layer's backward so that the tuner still gets the call's time."""
        y_TD = ExpertParallelDispatcher.__call__(self, x_TD, plan, experts)
        stats["forward_marks"] = (start, mark(x_TD))
        if y_TD.requires_grad and x_TD.requires_grad:
            y_TD.register_hook(lambda g: stats.__setitem__("backward_start", mark(g)))
            x_TD.register_hook(lambda g: stats.__setitem__(
                "backward_marks", (stats["backward_start"], mark(g))))
        return y_TD
