"""The engine behind offload_moe (entry.py): move the experts of a model's MoE layers out of it.

Every `MoE` layer gets its expert weights copied (fp32) into one shared `ExpertStore` and its
`experts` replaced by `OffloadedGroupedExperts` (for GroupedExperts) or
`OffloadedModuleExperts` (for ModuleExperts, run through functional_call); the model keeps no
expert parameters, so the user's dense optimizer only sees dense ones. The returned
`OffloadEngine` owns the device (simulated or CUDA), the store, the host optimizer and the
device cache, and is the handle of the training loop:

    engine = offload_moe(model, OffloadConfig(tier="host", device_budget_experts=2))
    opt = torch.optim.AdamW(model.parameters(), lr=...); engine.follow(opt)
    for step ...:
        for i in range(accum):
            engine.begin_micro_batch(last=i == accum - 1)
            loss_i.backward()
        engine.clip_grad_norm_(model.parameters(), 1.0)   # deferred mode only
        engine.step(); opt.step(); opt.zero_grad()

`engine.step()` steps the experts that have not stepped yet (all of them in deferred mode)
on the host worker and returns at once; per-expert fences keep the next forward correct.

Expert-parallel layers (`ExpertShard` experts, moescale.layers.shard) are offloaded too,
behind the static or the pipelined exchange: the store holds this rank's local experts only
(store expert l is global expert `expert_ids.start + l`), so each rank of an EP group streams
its own shard (docs/offloading.md, "Offloading with expert parallelism"). Nothing here knows
the exchange: the dispatchers call the containers through moescale.dispatch.protocol.

`build_engine` takes a concrete tier; `OffloadConfig(tier="auto", ...)` is resolved by the
planner above the engine (entry.py: offload_moe, auto.py), and `engine.plan` holds its pick.

Deliberately not here: the planner's model (planner.py), the dense half of a checkpoint (the
trainer's).
"""

from __future__ import annotations

import contextlib
from itertools import chain
from typing import Iterable, Iterator

import torch
from torch import nn

from moescale.devices import SimulatedDevice, make_device
from moescale.layers.experts import GroupedExperts, ModuleExperts
from moescale.layers.grouped_ffn import PARAM_NAMES
from moescale.layers.moe import MoE
from moescale.offload.cache import DeviceCache
from moescale.offload.usage_checks import NOT_STEPPED, MovedParameters
from moescale.offload.checkpoint import load_store, save_store
from moescale.offload.experts import OffloadedGroupedExperts
from moescale.offload.model_layers import disk_bytes, expert_shard, offloadable_layers, shifted
from moescale.offload.module_experts import OffloadedModuleExperts, module_layout
from moescale.offload.config import DTYPES, OffloadConfig
from moescale.offload.optimizer import AdamWConfig, HostOptimizer, worker_layout
from moescale.offload.records import ALL, G, M
from moescale.offload.store import ExpertLayout, ExpertStore, Key, StoreConfig

class OffloadEngine:
    """Device + store + host optimizer + device cache for the offloaded MoE layers of a model."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.dtype = DTYPES[config.compute_dtype]
        kind = config.device
        cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
        self.store = ExpertStore(StoreConfig(
            tier=config.store_tier, directory=config.directory,
            host_cache_bytes=config.host_cache_bytes, pin_memory=cuda,
            shared_memory=config.shared_memory, io_threads=config.io_threads,
            state=config.state, verify_reads=config.verify_reads,
            reserve_disk=config.reserve_disk))
        threads, workers = worker_layout(cuda, config.step_mode, config.store_tier == "disk")
        self.optimizer = HostOptimizer(self.store, config.optimizer or AdamWConfig(),
                                       config.step_mode, worker_threads=threads,
                                       workers=workers)
        self.device = None
        self.cache: DeviceCache | None = None
        self.layers: list = []  # the offloaded expert containers, by store layer
        self.last_micro_batch = True
        self.plan = None  # set by offload_moe (entry.py) for tier='auto'
        self._trace: list[tuple[int, list[int]]] = []
        self._grad_coef: float | None = None
        self.moved = MovedParameters()    # what offload_moe took out (usage_checks.py)
        self._awaiting_step = False       # a last micro-batch's backward ran, no step() yet
        self.snake = True                 # chunk_orders' snake order (False: ascending, tests)

    # ----------------------------------------------------------------- setup
    def add(self, experts: GroupedExperts, expert_init=None) -> OffloadedGroupedExperts:
        params = [(n, getattr(experts, n)) for n in PARAM_NAMES if getattr(experts, n) is not None]
        layout = ExpertLayout([(n, tuple(p.shape[1:])) for n, p in params])
        layer_index = len(self.store.layouts)
        if expert_init is not None:
            def init(e):
                return expert_init(layer_index, e, layout)
        elif any(p.is_meta for _, p in params):
            raise ValueError("the experts are on the meta device: pass expert_init=fn(layer, "
                             "expert, layout) -> flat fp32 tensor of layout.numel numbers")
        else:
            def init(e):
                return torch.cat([p.detach()[e].reshape(-1).float() for _, p in params])
        layer = self.store.add_layer(layout, experts.num_experts, init)
        module = OffloadedGroupedExperts(self, layer, experts.num_experts, experts.d_model,
                                         experts.d_ff, experts.act, experts.glu,
                                         experts.b1_EF is not None, layout)
        self.layers.append(module)
        return module

    def add_modules(self, experts: ModuleExperts, d_model: int) -> OffloadedModuleExperts:
        modules = list(experts.experts)
        layout = module_layout(modules)
        layer = self.store.add_layer(
            layout, len(modules),
            lambda e: torch.cat([p.detach().reshape(-1).float()
                                 for p in modules[e].parameters()]))
        module = OffloadedModuleExperts(self, layer, modules, d_model, layout)
        self.layers.append(module)
        return module

    def finish_setup(self) -> None:
        cfg = self.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        largest = max(lay.numel for lay in self.store.layouts) * itemsize
        budget = cfg.device_budget_bytes
        if cfg.device_budget_experts is not None:
            budget = int(cfg.device_budget_experts * largest)
        if budget is not None and budget < 2 * largest:
            what = "below one expert" if budget < largest else \
                "below one expert plus its gradient"
            raise ValueError(f"device budget of {budget} bytes is {what} ({largest} bytes each "
                             f"in {cfg.compute_dtype}); backward holds an expert's weights and "
                             f"its gradient at once: raise the device budget to at least "
                             f"{2 * largest} bytes (device_budget_experts=2)")
        self.device = make_device(cfg.device, budget)
        self.cache = DeviceCache(self.device, self.store, self.optimizer, self.dtype,
                                 lookahead=cfg.lookahead, pin_fraction=cfg.pinned_share,
                                 ema_decay=cfg.ema_decay)

    # ----------------------------------------------------------------- schedule
    def chunk_orders(self, layer: int, chunk_counts, traced: bool) -> list[list[int]]:
        """The forward's expert order per chunk (one chunk: the unpipelined call; a pipelined
        exchange runs chunk k's rows of every expert, k = 0..C-1): the experts with rows,
        pinned first; a traced call (one that will have a backward) is remembered for the
        backward's schedule, and the trace and the disk tier's schedule see the chunks one
        after another. Snake order: odd chunks take their
        experts in descending order (pinned ones still first), so chunk k+1 starts with the
        experts chunk k ended with and the device cache's walk reuses their copies instead
        of uploading them again (cache.py, retention)."""
        orders = []
        for k, counts in enumerate(chunk_counts):
            order = [e for e, n in enumerate(counts) if n][::-1 if k % 2 and self.snake else 1]
            order.sort(key=lambda e: not self.cache.is_resident((layer, e)))  # pinned first
            orders.append(order)
        flat = [e for order in orders for e in order]
        if traced and self._awaiting_step:
            raise ValueError(NOT_STEPPED)
        if traced:
            self._trace.append((layer, flat))
        self.cache.observe(layer, [sum(col) for col in zip(*chunk_counts)])
        # the coming accesses, masters now and whole records in backward: the disk tier reads
        # ahead and evicts by them (lazily made: the host tier never looks at them)
        self.store.set_upcoming(chain((((layer, e), M) for e in flat), self._backward_keys()),
                                keep=self.optimizer.pending)
        return orders

    def chunk_backward_orders(self, layer: int, orders: list[list[int]], last: bool,
                              last_chunk: dict[int, int]) -> list[list[int]]:
        """The backward's order per chunk (chunks in the given order; within one, pinned
        experts first, then the others in reverse: snake order again, from the forward's).
        last_chunk[e]: the chunk whose backward steps expert e in eager mode (default: every
        chunk, i.e. the only one); it is e's last chunk, so no later position of the walk
        sees a stepped master."""
        self._awaiting_step = self._awaiting_step or last
        for i in range(len(self._trace) - 1, -1, -1):
            if self._trace[i][0] == layer:
                del self._trace[i]
                break
        out = []
        for order in orders:
            pinned = [e for e in order if self.cache.is_resident((layer, e))]
            out.append(pinned + [e for e in reversed(order) if e not in pinned])
        # each expert: its upload, its gradient accumulation (and its eager step); uses by
        # gradient work still queued on the optimizer stay in front
        eager = last and self.config.step_mode == "eager"
        self.store.set_upcoming(chain(
            (((layer, e), ALL) for k, order in enumerate(out) for e in order
             for _ in range(3 if eager and last_chunk.get(e, k) == k else 2)),
            self._backward_keys()), keep=self.optimizer.pending)
        return out

    def _backward_keys(self) -> Iterator[tuple[Key, int]]:
        return (((layer, e), ALL) for layer, order in reversed(self._trace)
                for e in reversed(order) for _ in range(2))

    # ----------------------------------------------------------------- training loop
    def follow(self, dense_optimizer: torch.optim.Optimizer) -> None:
        """Share lr / betas / eps / weight_decay (and so the LR schedule) with it. Raises
        ValueError when it holds the experts' old parameters (built before offload_moe)."""
        self.moved.check(dense_optimizer)
        self.optimizer.follow(dense_optimizer)

    def begin_micro_batch(self, last: bool = True) -> None:
        """Declare whether the coming forward/backward is the last of this step's micro-batches
        (eager mode steps experts during that backward)."""
        self.last_micro_batch = bool(last)

    # ----------------------------------------------------------------- the stream's face
    @property
    def activation_policy(self) -> str:
        return self.config.activation_policy

    def walk(self, layer: int, order: list[int], grad_bytes: int = 0):
        """The device cache's walk (cache.py); grad_bytes > 0: backward's, with room for one
        gradient and the whole record cached for it (the disk tier reads it once)."""
        return self.cache.walk(layer, order, headroom=grad_bytes, whole_record=grad_bytes > 0)

    def reserve_gradient(self, key: Key, nbytes: int):
        """An expert's gradient on the device, charged to the budget until the host has it."""
        return self.device.reserve(nbytes, f"gradient of expert {key}", block=True,
                                   async_release=True)

    def stash(self, hidden: list[torch.Tensor]):
        """The offload policy: a hidden activation copied to the host until backward."""
        return self.device.download(hidden)

    def unstash(self, stashed) -> list[torch.Tensor]:
        return self.device.upload(stashed.wait()).wait()

    def hand_gradient(self, key: Key, grads, reservation, last: bool) -> None:
        if isinstance(self.device, SimulatedDevice):
            self.optimizer.accumulate(key, grads, last=last, on_done=reservation.release)
        else:
            transfer = self.device.download(grads)
            reservation.release()  # the download holds the device buffers via record_stream
            self.optimizer.accumulate(key, transfer, last=last)

    def clip_grad_norm_(self, dense_params: Iterable[torch.Tensor], max_norm: float,
                        reduce_expert_sq=None) -> float:
        """Global-norm clipping over dense and expert gradients (deferred mode), like
        torch.nn.utils.clip_grad_norm_; dense grads are scaled now, expert grads at step().

        reduce_expert_sq(sq) -> sq, if given, sums the expert part over the ranks whose stores
        hold disjoint experts (expert parallelism: an all-reduce over the EP group); the dense
        grads must then already be identical on every rank (averaged), so they count once."""
        if self.config.step_mode != "deferred":
            raise ValueError("clip_grad_norm_ over expert gradients needs step_mode='deferred' "
                             "(eager mode steps experts during backward)")
        grads = [p.grad for p in dense_params if p.grad is not None]
        dense_sq = torch.zeros((), dtype=torch.float32)
        for g in grads:
            sq = g.detach().float().norm(2).square()
            dense_sq += sq.full_tensor() if hasattr(sq, "full_tensor") else sq  # sharded dense
        expert_sq = self.optimizer.grad_norm_sq()
        if reduce_expert_sq is not None:
            expert_sq = reduce_expert_sq(expert_sq)
        total = float((dense_sq + expert_sq).sqrt())
        coef = min(1.0, max_norm / (total + 1e-6))
        for g in grads:
            g.detach().mul_(coef)
        self._grad_coef = coef
        return total

    def step(self) -> None:
        """End of an iteration: step every expert not stepped yet (returns at once)."""
        self.optimizer.step_all(grad_coef=self._grad_coef)
        self._end_iteration()

    def skip_step(self) -> None:
        """End an iteration without stepping: every expert's accumulated gradient is discarded
        (a training loop's guard against a non-finite loss or gradient norm). In eager mode
        the experts whose steps already ran during backward stay stepped (their gradients were
        finite: the host optimizer refuses the others)."""
        self.zero_grad()
        self.optimizer.end_iteration_unstepped()
        self._end_iteration()

    def _end_iteration(self) -> None:
        self._grad_coef = None
        self._awaiting_step = False
        self.last_micro_batch = True
        self._trace.clear()
        self.cache.repin(reserve_rotating=2 + self.config.lookahead)

    def zero_grad(self) -> None:
        """Discard every expert's accumulated gradient (e.g. after a backward that should not
        count); the dense side is the user's optimizer.zero_grad()."""
        self._awaiting_step = False       # nothing is left to apply
        self.optimizer.wait_all()
        for key in self.store.keys():
            rec = self.store.acquire(key, G)
            try:
                rec.grad_P.zero_()
            finally:
                self.store.release(key, grad_zero=True)

    def borrow_masters(self, on: bool) -> None:
        """Generation: let walks use the store's master rows in place (cache.py, Borrowing)
        where that is what a copy would give exactly (a CPU device with no simulated copy
        rate, fp32 masters computed in fp32); off: copies again."""
        device = self.cache.device
        self.cache.borrow = on and isinstance(device, SimulatedDevice) and \
            device.bandwidth_bytes_per_s is None and self.store.format.master == "fp32" and \
            self.cache.dtype == torch.float32

    @property
    def step_mode(self) -> str:
        return self.config.step_mode

    @property
    def device_budget_bytes(self) -> int | None:
        """The device's byte budget for expert copies and gradients (None: unbounded)."""
        return self.device.budget_bytes

    @property
    def device_peak_bytes(self) -> int:
        """The most bytes the device's ledger has held at once."""
        return int(self.device.peak_bytes)

    @property
    def num_uploads(self) -> int:
        """Expert copies uploaded to the device so far."""
        return self.cache.num_uploads

    @property
    def wait_seconds(self) -> float:
        """Seconds compute has waited for experts so far (DeviceCache.wait_seconds)."""
        return self.cache.wait_seconds

    def memory(self) -> dict:
        """The device's peak and budget, and the store tier's own figures (the disk tier's
        files and I/O bytes), after synchronize()."""
        self.synchronize()
        return {"device_peak_bytes": self.device_peak_bytes,
                "device_budget_bytes": self.device.budget_bytes, **self.store.tier_memory()}

    def take_wait_s(self) -> float:
        """Seconds compute waited for experts (uploads, their fences and disk reads) since the
        previous call: a training step's wait (DeviceCache.take_wait_s)."""
        return self.cache.take_wait_s()

    def synchronize(self) -> None:
        """Wait for every queued host task (optimizer steps, accumulations)."""
        self.optimizer.wait_all()
        self.device.synchronize()

    def expert_state(self, layer: int, e: int) -> dict[str, torch.Tensor]:
        """Copies of one expert's fp32 master tensors (after synchronize())."""
        self.synchronize()
        rec = self.store.acquire((layer, e))
        try:
            master_P = rec.master_P.to(torch.float32, copy=True)     # a bf16 master: exact
            return dict(self.store.layouts[layer].split(master_P))
        finally:
            self.store.release((layer, e))

    def save_checkpoint(self, directory: str, tag: str) -> str:
        """Write the expert store (masters, grads, moments, steps) atomically under directory;
        returns the store's checkpoint directory. The dense side is the trainer's job."""
        self.synchronize()
        return save_store(self.store, directory, tag)

    def load_checkpoint(self, directory: str, first_expert: int = 0,
                        total_experts: int | None = None, tag: str | None = None,
                        allow_other_run: bool = False) -> None:
        """Restore the expert store from the last complete checkpoint under directory (an
        expert-parallel rank: its experts from `first_expert` of `total_experts` per layer),
        verified first: a corrupt one raises StoreCheckpointError and changes nothing, another
        run's OtherRunError unless `allow_other_run` (checkpoint.py). `tag`: the store must be
        the one saved with that tag."""
        self.synchronize()
        self.cache.clear()
        self._awaiting_step = False
        load_store(self.store, directory, first_expert, total_experts, tag, allow_other_run)

    def close(self) -> None:
        """Wait for the queued host tasks and close every part, each one even when a task
        failed (its error is raised after): a store left open would keep pumping I/O into
        pools that interpreter shutdown closes."""
        with contextlib.ExitStack() as parts:      # closed in reverse: cache first
            parts.callback(self.device.close)
            parts.callback(self.store.close)
            parts.callback(self.optimizer.close)
            parts.callback(self.cache.clear)
            self.moved.close()
            self.synchronize()


def build_engine(model: nn.Module, config: OffloadConfig, *,
                 expert_init=None) -> OffloadEngine:
    """offload_moe for a concrete tier (host, pin, disk): tier 'auto' is resolved above the
    engine (entry.py: offload_moe), so the engine never imports the planner."""
    from moescale.models.resident import warn_offloaded_state_dict

    if config.tier == "auto":
        raise ValueError("build_engine takes a concrete tier; tier='auto' goes through "
                         "moescale.offload.offload_moe, which asks the planner first")
    moes = offloadable_layers(model, config)
    shards = [expert_shard(m) for m in moes]
    engine = OffloadEngine(config)
    engine.store.reserve_disk(sum(disk_bytes(m, s, config.state) for m, s in zip(moes, shards)))
    for moe, shard in zip(moes, shards):
        experts = moe.experts if shard is None else shard.local
        init = expert_init
        if shard is not None and expert_init is not None:   # local expert l = global start + l
            init = shifted(expert_init, shard.expert_ids.start)
        engine.moved.add(experts.parameters())
        if isinstance(experts, GroupedExperts):
            offloaded = engine.add(experts, init)
        elif isinstance(experts, ModuleExperts):
            offloaded = engine.add_modules(experts, moe.config.d_model)
        else:
            raise ValueError(f"offload_moe supports GroupedExperts and ModuleExperts; this "
                             f"layer has {type(experts).__name__}")
        offloaded.register_state_dict_post_hook(warn_offloaded_state_dict)   # says where
        if shard is None:
            moe.experts = offloaded
        else:
            shard.local = offloaded
            engine.store.first_expert[offloaded.layer_index] = shard.expert_ids.start
    engine.finish_setup()
    engine.moved.watch_optimizer_steps()
    return engine
