"""The planner's rates: what they are (`Rates`, ES-MoE's `A100_NODE`) and how this machine's are
measured, robustly: every rate is the median of several warm timings of a realistic size.

`RateProbes` holds one probe per rate, each a unit of work of the model's own size:
- compute: a moescale MoE layer's forward and backward with the rows an expert gets (small
  GEMMs run far below a square 1024^3 product on a CPU, and routing, gather, activation and
  combine cost about a third of the GEMMs' time, so neither predicts a step alone); the rate
  is the planner's count of expert GEMM FLOPs over the layer's whole time;
- stream: the same layer with its experts offloaded (host tier, a simulated device of 3 expert
  slots, eager steps): the walk that the pin / host / disk modes run, uploads, gradient hand-off
  and AdamW on the host threads included. Less the copy and AdamW times the other probes
  predict for it, this gives `stream_flops_per_s`, the compute rate of the streamed walk: on a
  CPU its copy and optimizer threads share the cores with the GEMMs, which then run slower
  than in the resident layer (1.2-1.3x the resident time here with 2 cores);
- adam: torch's fused AdamW over one expert's parameters (what the store steps at a time; on a
  CPU device on a one-thread team of its own, as the engine's eager workers run it),
  cycling through copies that add up to 256 MiB so that the state is cold in the CPU caches,
  as the store's is;
- copy: one expert's compute-precision copy from cold sources (the simulated device's upload);
- disk write / disk read: the store's own I/O path (`direct_io.DirectIO`: O_DIRECT, 8 MiB
  chunks, reader and writer thread pools, an aligned `SlotPool` buffer), 1 GiB per pass in 32
  MiB requests submitted at once: writes over one scratch file, reads each of a region of a
  file written before anything else (a region written just before would come back from a
  virtual disk's host cache at twice the disk's rate); the block device's bytes per pass
  (/proc/self/io) are recorded beside.
`sample()` times each probe once (`rounds` times at most: the read file holds that many
regions); `rates(skip)` gives the medians after the first `skip` samples (warm-ups: first
touch, thread-pool start, file allocation), `rates_of_round(i)` the rates of sample i alone. A
caller that times its own work can interleave `sample()` with it, so that rates and
measurement see the same load, and pair them round by round (the plan check does);
`measure_rates()` just samples `warmup + runs` times.

Deliberately not here: the step-time model (planner.py), a model's sizes (the callers pass
them; `ModelSpec.probe_sizes()` gives a model's), GPU probes (on a CUDA machine these are the
host's rates).
"""

from __future__ import annotations

import os
import statistics
from concurrent.futures import ThreadPoolExecutor
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from moescale.offload.omp_team import limit_this_thread
from moescale.offload.state_format import StateFormat

GIB = 1 << 30
COLD_BYTES = 256 << 20   # > 4x the last-level cache of common CPUs
STREAM_EXPERTS = 4       # experts of the probe layers (the per-expert shape is the model's)


@dataclass(kw_only=True)
class Rates:
    """Measured (or assumed) speeds; bytes and parameters per second."""

    flops_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    adam_params_per_s: float          # host AdamW
    device_adam_params_per_s: float   # AdamW on the device (device mode)
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    overlap: bool = True   # False: copies and host AdamW share the compute cores (a CPU
                           # "device"): the step is the sum of the parts, not their max
    stream_flops_per_s: float | None = None   # compute of the streamed walk (None: as above)
    samples: dict = field(default_factory=dict, compare=False)   # name -> every timed rate


# ES-MoE's machines: A100-40GB (bf16 ~ 150 TFLOP/s achieved), PCIe 4 x16 (~20 GB/s), a fast
# NVMe SSD (~3 GB/s read, ~2 GB/s write), host AdamW on many cores (~1.5 G params/s).
A100_NODE = Rates(flops_per_s=150e12, h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9,
                  adam_params_per_s=1.5e9, device_adam_params_per_s=50e9,
                  disk_read_bytes_per_s=3e9, disk_write_bytes_per_s=2e9)


def device_io_bytes() -> tuple[int, int]:
    """This process's bytes read from / written to the block device (/proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return -1, -1


@dataclass
class _Probe:
    work: Callable[[], None] | None
    amount: float                    # units of the rate per call of work
    samples: list[float] = field(default_factory=list)
    uploads: list[int] = field(default_factory=list)   # the stream probe's, per call
    thread: ThreadPoolExecutor | None = None   # where work runs (None: the caller's thread)

    def sample(self) -> None:
        start = time.perf_counter()
        if self.thread is None:
            self.work()
        else:
            self.thread.submit(self.work).result()
        self.samples.append(self.amount / max(time.perf_counter() - start, 1e-9))


def _replicas(item_bytes: int, cold_bytes: int) -> int:
    """How many copies of an item to cycle through so that `cold_bytes` are touched between two
    uses of one (the store's experts are cold in the CPU caches when they are used)."""
    return max(1, min(64, -(-cold_bytes // max(item_bytes, 1))))


def _compute_probe(rows: int, d_model: int, d_ff: int, glu: bool, top_k: int,
                   experts: int = STREAM_EXPERTS) -> _Probe:
    from moescale.layers.moe import MoE
    tokens = max(1, rows * experts // top_k)
    with torch.random.fork_rng():     # the probe must not move the caller's random stream
        torch.manual_seed(0)
        layer = MoE(d_model, experts, top_k, d_ff=d_ff, glu=glu)
        x = torch.randn(tokens, d_model)
    flops = 6 * tokens * top_k * (3 if glu else 2) * d_model * d_ff
    reps = max(1, min(64, int(2e9 // flops)))   # tens of milliseconds a timing, at least

    def work():
        for _ in range(reps):
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()
    return _Probe(work, reps * flops)


def _stream_probe(rows: int, d_model: int, d_ff: int, glu: bool, top_k: int,
                  experts: int = STREAM_EXPERTS, state: StateFormat = StateFormat()
                  ) -> tuple[_Probe, Callable[[], None]]:
    """(the probe, its close) of an offloaded layer's training step; amount: expert FLOPs."""
    from moescale.layers.moe import MoE
    from moescale.offload.engine import OffloadConfig, build_engine
    tokens = max(1, rows * experts // top_k)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = MoE(d_model, experts, top_k, d_ff=d_ff, glu=glu)
        x = torch.randn(tokens, d_model)
    engine = build_engine(layer, OffloadConfig(tier="host", device="cpu", step_mode="eager",
                                               device_budget_experts=3, master=state.master,
                                               moments=state.moments))

    probe = _Probe(None, 6 * tokens * top_k * (3 if glu else 2) * d_model * d_ff)

    def work():
        before = engine.num_uploads
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()
        engine.step()
        engine.synchronize()
        probe.uploads.append(engine.num_uploads - before)
    probe.work = work
    return probe, engine.close


def _adam_probe(numel: int, cold_bytes: int = COLD_BYTES,
                state: StateFormat = StateFormat()) -> _Probe:
    """The host optimizer's step of one expert: torch's fused AdamW on fp32 state, or, for a
    compact format, the store's own path (HostOptimizer on a host-tier store: decode, AdamW,
    encode) over records that cycle through cold_bytes."""
    if not state.exact:
        return _compact_adam_probe(numel, cold_bytes, state)
    from torch.optim.adamw import adamw
    opts = dict(foreach=False, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
                weight_decay=0.01, eps=1e-8, maximize=False)
    states = [(torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel),
               torch.zeros(())) for _ in range(_replicas(16 * numel, cold_bytes))]

    def work():
        for p, g, m1, m2, step in states:
            adamw([p], [g], [m1], [m2], [], [step], **opts)
    return _Probe(work, len(states) * numel)


def _compact_adam_probe(numel: int, cold_bytes: int, state: StateFormat) -> _Probe:
    from moescale.offload.optimizer import AdamWConfig, HostOptimizer
    from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig
    store = ExpertStore(StoreConfig(tier="host", state=state))
    layout = ExpertLayout([("w", (numel,))])
    count = _replicas(layout.record_bytes(state), cold_bytes)
    store.add_layer(layout, count, lambda e: torch.randn(numel))
    optimizer = HostOptimizer(store, AdamWConfig())
    for key in store.keys():
        store.acquire(key).grad_P.normal_()
        store.release(key)

    def work():
        optimizer._step(list(store.keys()), optimizer.hparams(), None)
        for key in store.keys():   # the step zeroed it: a gradient again (one pass of the
            store.acquire(key).grad_P.fill_(1e-3)   # step's ~20, timed with it)
            store.release(key)
    return _Probe(work, count * numel)


def _copy_probe(nbytes: int, cold_bytes: int = COLD_BYTES) -> _Probe:
    sources = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
               for _ in range(_replicas(nbytes, cold_bytes))]
    dst = torch.empty_like(sources[0])

    def work():
        for src in sources:
            dst.copy_(src)
    return _Probe(work, len(sources) * nbytes)


class _DiskFiles:
    """Probe files under a directory, moved whole through DirectIO: a scratch file that every
    write pass overwrites, and `rounds` regions of a read file written once at the start and
    each read once, in order. A file written just before is read back from a virtual disk's
    host cache at up to twice the disk's rate; a region written long before (the read file is
    made first; everything since, a store's files included, lies between) is not."""

    def __init__(self, directory: str | None, file_bytes: int, rounds: int,
                 request_bytes: int = 32 << 20, threads: int = 4) -> None:
        from moescale.offload.direct_io import ALIGN, DirectIO, SlotPool, align_up
        self.request_bytes = align_up(min(request_bytes, file_bytes), ALIGN)
        self.file_bytes = align_up(file_bytes, self.request_bytes)
        self.threads, self.rounds, self._reads = threads, rounds, 0
        self._dir = tempfile.TemporaryDirectory(prefix="moescale-rates-", dir=directory)
        self.scratch = os.path.join(self._dir.name, "write.bin")
        self.cold = os.path.join(self._dir.name, "read.bin")
        self._pool = SlotPool(1, self.request_bytes)
        self._buf = self._pool.slots[0]
        self._buf.copy_(torch.randint(0, 255, (self.request_bytes,), dtype=torch.uint8))
        self.io = DirectIO(threads)
        self.device_bytes: list[dict] = []   # per pass: what the block device saw
        try:
            self._move(True, self.cold, 0, rounds * self.file_bytes, record=False)
        except BaseException:
            self.close()
            raise

    def _move(self, write: bool, path: str, start: int, stop: int, record: bool = True):
        before = device_io_bytes()
        futures = [self.io.write(path, off, self._buf, create=True) if write
                   else self.io.read(path, off, self._buf)
                   for off in range(start, stop, self.request_bytes)]
        for f in futures:
            f.result()
        if record:
            after = device_io_bytes()
            k = 1 if write else 0
            self.device_bytes.append(dict(kind="write" if write else "read",
                                          device_bytes=after[k] - before[k]))

    def write_pass(self) -> None:
        self._move(True, self.scratch, 0, self.file_bytes)

    def read_pass(self) -> None:
        if self._reads >= self.rounds:
            raise ValueError(f"the disk probe was made for {self.rounds} rounds; make it with "
                             "more (each round reads a region not read before)")
        start = self._reads * self.file_bytes
        self._reads += 1
        self._move(False, self.cold, start, start + self.file_bytes)

    def close(self) -> None:
        self.io.close()
        self._pool.close()
        self._dir.cleanup()


class RateProbes:
    """One probe per rate at a model's sizes; `sample()` times each once (see the top)."""

    def __init__(self, *, gemm_rows: int = 512, d_model: int = 1024, d_ff: int = 4096,
                 glu: bool = False, top_k: int = 2, expert_params: int = 1 << 22,
                 copy_bytes: int = 16 << 20, disk_dir: str | None = None, disk: bool = True,
                 disk_file_bytes: int = GIB, rounds: int = 7,
                 state: StateFormat = StateFormat()) -> None:
        self.sizes = dict(rows_per_expert=gemm_rows, d_model=d_model, d_ff=d_ff, glu=glu,
                          top_k=top_k, expert_params=expert_params, copy_bytes=copy_bytes)
        shape = (max(1, gemm_rows), d_model, d_ff, glu, top_k)
        stream, self._close_stream = _stream_probe(*shape, state=state)
        adam = _adam_probe(max(expert_params, 1 << 16), state=state)
        # on a CPU device the engine's eager steps run on one-thread teams of their own
        # (optimizer.worker_layout): the rate of one such worker
        self._adam_thread = None if torch.cuda.is_available() else ThreadPoolExecutor(
            1, thread_name_prefix="moescale-rates-adam", initializer=limit_this_thread,
            initargs=(1,))
        adam.thread = self._adam_thread
        self.probes = dict(flops_per_s=_compute_probe(*shape),
                           stream_step_flops_per_s=stream,
                           adam_params_per_s=adam,
                           copy_bytes_per_s=_copy_probe(max(copy_bytes, 1 << 20)))
        self.disk = _DiskFiles(disk_dir, disk_file_bytes, rounds) if disk else None
        if self.disk is not None:
            size = self.disk.file_bytes
            self.probes["disk_write_bytes_per_s"] = _Probe(self.disk.write_pass, size)
            self.probes["disk_read_bytes_per_s"] = _Probe(self.disk.read_pass, size)

    def sample(self) -> None:
        for probe in self.probes.values():   # the disk's write comes before its read
            probe.sample()

    def rates(self, skip: int) -> Rates:
        """Medians of the samples after the first `skip` (>= 1: the first is cold)."""
        taken = {name: p.samples[skip:] for name, p in self.probes.items()}
        if skip < 1 or not all(taken.values()):
            raise ValueError(f"skip={skip!r} must be >= 1 and leave samples (have "
                             f"{len(next(iter(self.probes.values())).samples)})")
        samples = dict(taken, warmup_samples=skip, sizes=self.sizes)
        if self.disk is not None:
            samples["disk"] = dict(direct=bool(self.disk.io.direct),
                                   file_bytes=self.disk.file_bytes,
                                   request_bytes=self.disk.request_bytes,
                                   threads=self.disk.threads,
                                   device_bytes_per_pass=self.disk.device_bytes)
        return self._rates({name: statistics.median(v) for name, v in taken.items()}, samples)

    def rates_of_round(self, i: int) -> Rates:
        """The rates of sample i alone (to pair with what the caller timed in that round)."""
        return self._rates({name: p.samples[i] for name, p in self.probes.items()}, {})

    def _rates(self, med: dict, samples: dict) -> Rates:
        copy_bw = med["copy_bytes_per_s"]
        # the stream probe's step less what the copy and AdamW probes predict of it: its uploads
        # (counted), one gradient copied back and one AdamW step per expert
        stream = self.probes["stream_step_flops_per_s"]
        step_s = stream.amount / med["stream_step_flops_per_s"]
        uploads = statistics.median(stream.uploads) if stream.uploads else 2 * STREAM_EXPERTS
        parts_s = (uploads + STREAM_EXPERTS) * self.sizes["copy_bytes"] / copy_bw + \
            STREAM_EXPERTS * self.sizes["expert_params"] / med["adam_params_per_s"]
        stream_flops = stream.amount / max(step_s - parts_s, step_s / 2)
        return Rates(flops_per_s=med["flops_per_s"], stream_flops_per_s=stream_flops,
                     h2d_bytes_per_s=copy_bw, d2h_bytes_per_s=copy_bw,
                     adam_params_per_s=med["adam_params_per_s"],
                     device_adam_params_per_s=med["adam_params_per_s"],
                     disk_read_bytes_per_s=med.get("disk_read_bytes_per_s", float("inf")),
                     disk_write_bytes_per_s=med.get("disk_write_bytes_per_s", float("inf")),
                     overlap=torch.cuda.is_available(), samples=samples)

    def close(self) -> None:
        self._close_stream()
        self._close_stream = lambda: None
        if self._adam_thread is not None:
            self._adam_thread.shutdown(wait=True)
            self._adam_thread = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def __enter__(self) -> "RateProbes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_rates(disk_dir: str | None = None, *, runs: int = 5, warmup: int = 2,
                  **sizes) -> Rates:
    """This machine's rates at the given sizes (`ModelSpec.probe_sizes()` gives a model's):
    each the median of `runs` timings after `warmup` (disk=False: no disk probe, its rates
    are then inf)."""
    if runs < 1 or warmup < 1:
        raise ValueError(f"runs={runs!r} and warmup={warmup!r} must be >= 1 (the first timing "
                         "of anything is cold)")
    with RateProbes(disk_dir=disk_dir, rounds=warmup + runs, **sizes) as probes:
        for _ in range(warmup + runs):
            probes.sample()
        return probes.rates(skip=warmup)
