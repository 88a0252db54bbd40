"""Per-expert host AdamW on the ExpertStore, run on worker threads, with per-expert fences.

The math is torch's own AdamW (`torch.optim.adamw.adamw`, the functional form behind
`torch.optim.AdamW`: single-tensor, foreach or fused CPU kernel), applied to each expert's flat
fp32 master, gradient accumulator and moments. Compact state (a bf16 master, bf16 or int8
moments: state_format.py) is stepped one expert at a time on the worker by compact_adamw.py:
with int8 moments moescale's own AdamW (the same formula, every operation rounded on its own;
decode, step and encode in one pass per block where a C compiler built the loop), with bf16
moments torch's AdamW on decoded fp32 chunks. Hyper-parameters (lr, betas, eps, weight decay)
are read when a step is submitted, from the config or from a dense optimizer the engine
follows (`follow(dense_optimizer)`), so an LR scheduler drives both.

Every host-side task for an expert (gradient accumulation, step) runs on one worker thread in
submission order (one worker by default; with several, an expert always uses the same one).
Modes:
- `eager` (ES-MoE): when a gradient of the last micro-batch is handed over, the expert's step
  is queued right behind its accumulation and overlaps the rest of backward;
- `deferred`: backward only accumulates; `step_all()` after backward steps every expert (and
  `grad_norm_sq()` allows global-norm clipping over dense + expert gradients first).
Every expert steps every iteration, as torch.optim.AdamW does for a stacked expert parameter
(experts without tokens get a zero gradient: their moments decay and weight decay applies).

No expert steps with a non-finite gradient: every step first checks each expert's gradient norm
and refuses (counts in `skipped_steps`, drops the gradient) one that is not finite or whose
square would overflow float32. This is the eager mode's share of the training loop's step guard
(moescale/train/guard.py): there the step's global norm is not known when experts step.

Fences: `step_fence(key)` is the future of the expert's last queued step; a device upload of
that expert waits on it, so a forward never reads a master whose step is still running.

Deliberately not here: dense parameters (the user's own optimizer), gradient scaling for fp16
(fp16 compute should use bf16 or a scaler on the dense side; not done yet).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.optim.adamw import adamw

from moescale.devices import Transfer
from moescale.offload.compact_adamw import step_compact
from moescale.offload.records import ALL, G, STATE
from moescale.offload.omp_team import limit_this_thread
from moescale.offload.state_format import StateCodec
from moescale.offload.store import ExpertStore, Key

IMPLS = ("single", "foreach", "fused")
OVERFLOW_NORM = math.sqrt(torch.finfo(torch.float32).max)   # ~1.8e19: its square overflows
STEP_MODES = ("eager", "deferred")


@dataclass(kw_only=True)
class AdamWConfig:
    """Expert AdamW hyper-parameters (used unless the engine follows a dense optimizer)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    impl: str = "fused"

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr!r} must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is unknown; use one of {', '.join(IMPLS)}")


def worker_layout(cuda: bool, step_mode: str, disk: bool) -> tuple[int | None, int]:
    """(worker_threads, workers) of an engine's host optimizer (omp_team.py). On a CUDA device
    one worker with torch's team. On a CPU device the cores are shared with the compute: eager
    steps run beside backward on one-thread teams of their own, two workers on the disk tier
    (both cores step experts while the compute waits for records; past RAM, bf16+int8, 16.1 ->
    13.2 s per step); deferred steps run while the compute waits for them: one worker, every
    core."""
    if cuda or step_mode == "deferred":
        return None, 1
    return 1, 2 if disk and (os.cpu_count() or 1) >= 2 else 1


class HostOptimizer:
    """Accumulates expert gradients and steps experts with AdamW on a worker thread."""

    def __init__(self, store: ExpertStore, config: AdamWConfig, mode: str = "eager",
                 worker_threads: int | None = None, workers: int = 1) -> None:
        """worker_threads: each worker's own OpenMP team (omp_team.py; 1 where compute runs
        on the same cores: a CPU device); None: torch's process-wide setting. workers: worker
        threads; an expert's tasks all run on one of them (`_worker_of`), in order."""
        if mode not in STEP_MODES:
            raise ValueError(f"step_mode={mode!r} is unknown; use one of {', '.join(STEP_MODES)}")
        if workers < 1:
            raise ValueError(f"workers={workers!r} must be >= 1")
        self.store, self.config, self.mode = store, config, mode
        self.worker_threads = worker_threads
        self._workers = [ThreadPoolExecutor(
            1, thread_name_prefix=f"moescale-optim{i}",
            initializer=None if worker_threads is None else limit_this_thread,
            initargs=() if worker_threads is None else (worker_threads,))
            for i in range(workers)]
        self._lock = threading.Lock()
        self._last_task: dict[Key, Future] = {}
        self._step_fence: dict[Key, Future] = {}
        self._stepped: set[Key] = set()
        self._spares_dropped: list[Future] = []   # the last step_all's spare-gradient frees
        self._follow = None
        self.step_seconds = 0.0         # wall time of the worker's steps (waits included)
        self.step_cpu_seconds = 0.0     # the worker's CPU time in them (its own team's)
        self.skipped_steps = 0     # expert steps refused for a non-finite gradient
        self._codecs = threading.local()   # compact state's work buffers, one set per worker

    # ----------------------------------------------------------------- hyper-parameters
    def follow(self, dense_optimizer: torch.optim.Optimizer | None) -> None:
        """Take lr, betas, eps and weight_decay from dense_optimizer.param_groups[0]."""
        self._follow = dense_optimizer

    def hparams(self) -> dict:
        cfg = self.config
        hp = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        if self._follow is not None:
            group = self._follow.param_groups[0]
            hp.update({k: group[k] for k in hp if k in group})
        hp["lr"] = float(hp["lr"])
        return hp

    # ----------------------------------------------------------------- tasks
    def _worker_of(self, key: Key) -> int:
        """The worker that runs every task of this expert (neighbouring experts alternate)."""
        return (31 * key[0] + key[1]) % len(self._workers)

    def _submit(self, key: Key, fn: Callable, *args, is_step: bool = False) -> Future:
        with self._lock:
            future = self._workers[self._worker_of(key)].submit(fn, *args)
            self._last_task[key] = future
            if is_step:
                self._step_fence[key] = future
                self._stepped.add(key)
        return future

    def pending(self, key: Key) -> bool:
        """Whether a task of this expert is queued or running."""
        task = self._last_task.get(key)
        return task is not None and not task.done()

    def step_fence(self, key: Key) -> Future | None:
        return self._step_fence.get(key)

    def wait_step(self, key: Key) -> None:
        fence = self._step_fence.get(key)
        if fence is not None:
            fence.result()

    def accumulate(self, key: Key, grads, *, last: bool,
                   on_done: Callable[[], None] | None = None) -> None:
        """Queue the expert's gradient tensors (in layout order, any float dtype, on the host;
        or a Transfer of them) to be added to its fp32 accumulator, then call on_done(). In
        eager mode with last=True the expert's step follows at once."""
        self._submit(key, self._accumulate, key, grads, on_done)
        if last and self.mode == "eager":
            self._submit(key, self._step, [key], self.hparams(), None, is_step=True)

    def _accumulate(self, key: Key, grads, on_done) -> None:
        try:
            if isinstance(grads, Transfer):  # a device -> host copy still in flight
                grads = grads.wait()
            rec = self.store.acquire(key, G)
            try:
                views = self.store.layouts[key[0]].split(rec.grad_P).values()
                for view, grad in zip(views, grads, strict=True):
                    view.add_(grad.reshape(view.shape))
            finally:
                self.store.release(key, dirty=True, rows=G)
        finally:
            if on_done is not None:
                on_done()

    def _steppable(self, grad_P: torch.Tensor) -> bool:
        """Whether an expert may step with this gradient: finite, and small enough that its
        square (AdamW's second moment) stays finite in float32. If not, the step is refused
        and counted in `skipped_steps`; the caller drops the gradient."""
        norm = float(torch.linalg.vector_norm(grad_P))
        if math.isfinite(norm) and norm < OVERFLOW_NORM:
            return True
        with self._lock:
            self.skipped_steps += 1
        return False

    def _step(self, keys: Sequence[Key], hp: dict, grad_coef: float | None) -> None:
        start, cpu_start = time.perf_counter(), time.thread_time()
        recs = [self.store.acquire(k) for k in keys]
        try:
            stepped = [r for r in recs if self._steppable(r.grad_P)]
            if grad_coef is not None:
                for r in stepped:
                    r.grad_P.mul_(grad_coef)
            if stepped and self.store.format.exact:
                self._adamw([r.master_P for r in stepped], [r.grad_P for r in stepped],
                            [r.exp_avg_P for r in stepped], [r.exp_avg_sq_P for r in stepped],
                            [r.step_t for r in stepped], hp)
            for r in stepped if not self.store.format.exact else ():
                self._step_compact(r, hp)
            for r in recs:
                r.grad_P.zero_()
            for r in stepped:
                self.store.bump_version(r.key)
        finally:
            for k in keys:
                self.store.release(k, dirty=True, rows=STATE, grad_zero=True)
        with self._lock:
            self.step_seconds += time.perf_counter() - start
            self.step_cpu_seconds += time.thread_time() - cpu_start

    def _adamw(self, params, grads, exp_avgs, exp_avg_sqs, steps, hp: dict) -> None:
        impl = self.config.impl
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=impl == "foreach",
              fused=impl == "fused" or None, amsgrad=False, beta1=hp["betas"][0],
              beta2=hp["betas"][1], lr=hp["lr"], weight_decay=hp["weight_decay"],
              eps=hp["eps"], maximize=False)

    def _step_compact(self, rec, hp: dict) -> None:
        """One expert's AdamW on compact state (compact_adamw.py; a bf16 master by stochastic
        rounding keyed by (layer, expert, step)); the step count then advances once."""
        codec = getattr(self._codecs, "codec", None)
        if codec is None:
            codec = self._codecs.codec = StateCodec(self.store.format)
        numel = self.store.layouts[rec.key[0]].numel
        layer, e = rec.key      # keyed by the global expert: any rank count rounds alike
        where = (layer, self.store.first_expert[layer] + e, int(rec.step_t) + 1)
        step_compact(codec, (rec.master_P, rec.exp_avg_P, rec.exp_avg_sq_P), rec.grad_P, numel,
                     where, hp, lambda *lists: self._adamw(*lists, hp))
        rec.step_t.add_(1)

    def wait_all(self) -> None:
        """Block until every queued task has run (re-raising the first error)."""
        with self._lock:
            futures = [*self._last_task.values(), *self._spares_dropped]
        for f in futures:
            f.result()

    # ----------------------------------------------------------------- end of iteration
    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of every expert gradient accumulator (after wait_all)."""
        self.wait_all()
        total = torch.zeros((), dtype=torch.float32)
        for key in self.store.keys():
            rec = self.store.acquire(key, G)
            try:
                total += rec.grad_P.norm(2).square()
            finally:
                self.store.release(key)
        return total

    def step_all(self, grad_coef: float | None = None, group: int = 16) -> None:
        """Step every expert not yet stepped this iteration (all of them in deferred mode),
        scaling gradients by grad_coef first (global-norm clipping); then start a new
        iteration. Returns at once: the steps run on the worker, fenced per expert."""
        if grad_coef is not None and self.mode == "eager":
            raise ValueError("gradient clipping over expert gradients needs step_mode="
                             "'deferred' (eager mode steps experts during backward)")
        hp = self.hparams()
        pending = [k for k in self.store.keys() if k not in self._stepped]
        if self.store.config.tier == "disk":
            group = 1  # never pin more records than the host cache holds
            self.store.set_upcoming([(k, ALL) for k in pending], keep=self.pending)
        for w in range(len(self._workers)):    # a group's experts share their worker
            mine = [k for k in pending if self._worker_of(k) == w]
            for i in range(0, len(mine), group):
                chunk = mine[i:i + group]
                future = self._submit(chunk[0], self._step, chunk, hp, grad_coef, is_step=True)
                with self._lock:
                    for k in chunk:
                        self._step_fence[k] = future
                        self._last_task[k] = future
        with self._lock:
            self._stepped.clear()
        # after every step each worker has queued, the spare gradients go (wait_all waits)
        spares = [w.submit(self.store.host_grads.drop_spares) for w in self._workers]
        with self._lock:
            self._spares_dropped = spares

    def end_iteration_unstepped(self) -> None:
        """End an iteration without stepping the experts not stepped yet (the caller has
        discarded their gradients): the next iteration starts afresh."""
        with self._lock:
            self._stepped.clear()

    def close(self) -> None:
        for worker in self._workers:
            worker.shutdown(wait=True)
