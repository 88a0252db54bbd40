"""The offloading planner: memory per tier and predicted step time of each mode, and a pick.

Modes (ES-MoE's menu):
- `device`: every expert's full state on the device (fp32 master, grad, two moments, plus a
  compute-precision copy when that is not fp32);
- `pin`: the hottest `pin_fraction` of experts (25% as in ES-MoE) keep compute copies on the
  device; all expert state lives on the host; the rest stream through rotating slots;
- `host`: all expert state on the host; the device holds (2 + lookahead) rotating expert slots
  and one gradient buffer;
- `disk`: as `host`, but the state lives on the disk and the host holds a bounded cache.
Dense parameters (attention, embeddings, norms, routers) and their AdamW state stay on the
device in every mode, and so do the activations (estimated per MoE layer from the tokens of a
micro-batch, the activation policy `keep`).

Step time (micro_batches x (forward + backward), then the optimizer), summed over layers:
  compute  = 3 * 2 * tokens * top_k * (2 or 3 GEMMs) * d_model * d_ff / flops_per_s
             (pin / host / disk: / stream_flops_per_s, the streamed walk's rate, when known)
  upload   = experts_used * 2 (forward + backward) * P * itemsize / h2d_bytes_per_s
  download = experts_used * P * itemsize / d2h_bytes_per_s   (gradients)
  adam     = E * P / adam_params_per_s                       (host AdamW over all experts)
  disk     = read_bytes / disk_read + write_bytes / min(disk_write, disk_read)
             (`disk_traffic`: one device serves both; sustained writes are charged no faster
             than cold reads, see `disk_seconds`)
(compute and transfers once per micro-batch, adam once per step). With overlap (a GPU) the
step is max(compute, transfers, adam in eager mode) (the pipeline overlaps them) plus adam in
deferred mode; on a CPU "device" (`Rates.overlap` False) copies and AdamW share the cores, so
it is their sum, AdamW divided among the engine's workers (two for the disk tier's eager steps:
optimizer.worker_layout). The disk tier's I/O runs on its own threads beside all of that: its step is
max(that step, disk) (deferred with overlap: max(compute, transfers, reads) + max(adam,
writes)). Dense compute is added to compute. `experts_used` is min(E, tokens * top_k) (an
expert with no tokens is never uploaded). The device mode pays compute + device AdamW.

Disk traffic per step (`disk_traffic`, the store of disk_tier.py; rows in the model's state
format (fp32 [P], or a bf16 master, bf16 or int8 moments: state_format.py) padded to 4 KiB for
direct I/O; every expert steps every iteration): the forward reads the
master row of every used expert; the last backward reads master + two moments of every expert
and writes them back (the gradient row is zero between steps and never moves); each extra
micro-batch of accumulation adds a forward and a backward master read and the gradient row
written then read back, for each used expert; deferred steps add the backward's master read
and the gradient row written and read back, as an extra micro-batch does. A host cache of C record slots (`host_cache_bytes
// 4 rows`) out of N = L E records saves nothing up to C = N/4, then 4 rows per slot up to
N/2 (N rows saved), then 6 rows per slot up to C = N (all reads saved): the store's schedule
(forward sweep, backward in reverse, Belady eviction), fitted to its measured bytes and checked
against a real store by tests/offload/test_planner.py.

`Rates` are measured (`rates.measure_rates(**spec.probe_sizes())`: medians of warm timings at
this model's sizes, the disk through the store's own direct-I/O path) or given (`A100_NODE`).
`largest_experts()` finds, for each mode, the largest expert count whose memory fits.

Deliberately not here: activation recomputation/offload in the estimate (policy `keep`
assumed), multi-device placement, the all-to-all.

Legend: E experts per layer, P parameters of one expert.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from moescale.offload.optimizer import worker_layout
from moescale.offload.rates import A100_NODE, Rates
from moescale.offload.records import POS_GRAD, POS_MASTER
from moescale.offload.state_format import RecordGeometry, StateFormat

MODES = ("device", "pin", "host", "disk")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(kw_only=True)
class ModelSpec:
    """What the planner needs to know of a model (MoE layers are all alike)."""

    moe_layers: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    tokens: int = 4096            # tokens per micro-batch
    micro_batches: int = 1        # per optimizer step (gradient accumulation)
    glu: bool = False
    dtype: str = "bfloat16"       # compute precision
    dense_params: int | None = None   # None: 4 d_model^2 (attention) per layer + routers
    vocab_size: int = 0           # token embedding + LM head (0: not counted)
    tie_embeddings: bool = True   # the head shares the embedding's weights
    master: str = "fp32"          # the store's expert master weights (state_format.py)
    moments: str = "fp32"         # the store's Adam moments

    def __post_init__(self) -> None:
        StateFormat(master=self.master, moments=self.moments)     # ValueError if unknown
        for name in ("moe_layers", "d_model", "d_ff", "num_experts", "top_k", "tokens",
                     "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("dense_params", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype={self.dtype!r} is unknown; use one of {', '.join(ITEMSIZE)}")
        if self.dense_params is None:
            self.dense_params = self.moe_layers * (4 * self.d_model ** 2 +
                                                   self.d_model * self.num_experts)

    @property
    def vocab_params(self) -> int:
        """Embedding (and an untied head): vocab_size x d_model each."""
        return self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

    @property
    def expert_params(self) -> int:
        return (3 if self.glu else 2) * self.d_model * self.d_ff

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def state(self) -> StateFormat:
        return StateFormat(master=self.master, moments=self.moments)

    def geometry(self) -> RecordGeometry:
        """An expert's disk-tier record: rows padded for direct I/O."""
        return RecordGeometry(self.state, self.expert_params)

    def probe_sizes(self) -> dict:
        """The sizes at which `rates.measure_rates` should time this model: an MoE layer with
        the rows an expert gets on average, one expert's AdamW and compute-precision copy."""
        return dict(gemm_rows=max(1, self.tokens * self.top_k // self.num_experts),
                    d_model=self.d_model, d_ff=self.d_ff, glu=self.glu, top_k=self.top_k,
                    expert_params=self.expert_params,
                    copy_bytes=self.expert_params * self.itemsize, state=self.state)


@dataclass(kw_only=True)
class Budgets:
    device_bytes: int
    host_bytes: int
    disk_bytes: int = 0
    host_cache_bytes: int | None = None   # disk tier; None: half the host budget

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")


@dataclass
class ModeEstimate:
    mode: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    fits: bool
    step_s: float
    parts: dict
    # part -> (seconds of work per step, seconds of them on the step's critical path); the
    # second column sums to step_s (overlapped work shows only what it adds)
    breakdown: dict[str, tuple[float, float]] = field(default_factory=dict)


class _Path:
    """The step's critical path built part by part, and each part's share of it."""

    def __init__(self) -> None:
        self.work: dict[str, float] = {}
        self.exposed: dict[str, float] = {}

    def serial(self, base: float, parts: dict[str, float]) -> float:
        """Parts run one after another after `base` seconds: all of them add."""
        for name, s in parts.items():
            self.work[name], self.exposed[name] = s, s
        return base + sum(parts.values())

    def beside(self, base: float, parts: dict[str, float]) -> float:
        """Parts (one after another) run beside the `base` seconds already on the path: only
        their excess over it adds, shared in proportion to their work."""
        total = sum(parts.values())
        extra = max(0.0, total - base)
        for name, s in parts.items():
            self.work[name], self.exposed[name] = s, extra * s / total if total > 0 else 0.0
        return base + extra

    def table(self) -> dict[str, tuple[float, float]]:
        return {name: (self.work[name], self.exposed[name]) for name in self.work}


def _activation_bytes(m: ModelSpec) -> int:
    rows = m.tokens * m.top_k
    per_layer = m.tokens * m.d_model + rows * m.d_ff * (2 if m.glu else 1) + rows * 16
    logits = m.tokens * m.vocab_size * (m.itemsize + 4)   # logits + fp32 log-softmax
    return m.moe_layers * per_layer * m.itemsize + logits


def cache_saved_rows(slots: int, records: int) -> float:
    """Rows per step that a host cache of `slots` record slots spares the disk tier's reads,
    out of `records` expert records (the fit described at the top of this file)."""
    n = records
    if slots >= n:
        return float("inf")
    if slots <= n / 4:
        return 0.0
    if slots <= n / 2:
        return 4.0 * (slots - n / 4)
    return n + 6.0 * (slots - n / 2)


def disk_traffic(m: ModelSpec, cache_bytes: int, step_mode: str = "eager") -> tuple[int, int]:
    """(bytes read, bytes written) per optimizer step by the disk tier, steady state. Deferred
    steps move what an extra micro-batch does: the backward reads the master again and leaves
    the gradient row in the file, which the step reads back (measured against a real store:
    tests/offload/test_planner.py)."""
    geo = m.geometry()
    master, state, grad = geo.strides[POS_MASTER], geo.offsets[POS_GRAD], geo.strides[POS_GRAD]
    records = m.moe_layers * m.num_experts
    used = m.moe_layers * min(m.num_experts, m.tokens * m.top_k)
    extra = m.micro_batches - 1 + (step_mode == "deferred")
    # forward masters of every micro-batch; master + moments for the step; per extra
    # micro-batch a backward master read and the gradient row written, then read back
    read = m.micro_batches * used * master + records * state + extra * used * (master + grad)
    write = records * state + extra * used * grad
    # the cache's saving was fitted in rows of fp32 records, 4 rows per slot where a record
    # stays cached through a forward and its backward: the forward's master and the
    # backward's master + moments, so an fp32 row stands for a quarter of (master + state)
    saved = cache_saved_rows(cache_bytes // geo.total, records) * (master + state) / 4
    return int(max(read - saved, 0)), int(write)


def disk_seconds(read: float, write: float, r: Rates) -> tuple[float, float]:
    """(seconds of reads, seconds of writes) per step on the disk tier's device. Writes are
    charged at the probed write rate, but never faster than the cold-read rate: the store
    path's write probe (1 GiB over a file written just before) ran at 1.55-2.0x the cold read
    here, but past RAM, with every byte of the steps' 20-58 GB at the device, a step moved
    (read + written) / step time = 0.90-1.04x the cold-read probe in all three state formats,
    and dd's fsynced direct writes ran at 0.8-0.9x its reads: a short write burst is absorbed by
    the device's (or a virtual disk's host) cache and a sustained one is not. On a device
    whose writes are slower than its reads (most SSDs) the write probe is the lower and is
    used as it is."""
    return read / r.disk_read_bytes_per_s, \
        write / min(r.disk_write_bytes_per_s, r.disk_read_bytes_per_s)


def estimate(m: ModelSpec, b: Budgets, r: Rates, mode: str, *, step_mode: str = "eager",
             pin_fraction: float = 0.25, lookahead: int = 1) -> ModeEstimate:
    """Memory per tier and predicted step time of one mode, with its breakdown."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    P, E, L = m.expert_params, m.num_experts, m.moe_layers
    copy_bytes = P * m.itemsize                        # one expert in compute precision
    state_bytes = 16 * P + (0 if m.itemsize == 4 else copy_bytes)
    dense_params = m.dense_params + m.vocab_params
    dense = dense_params * (16 + (0 if m.itemsize == 4 else m.itemsize)) + _activation_bytes(m)
    flops = 3 * 2 * m.tokens * m.top_k * (3 if m.glu else 2) * m.d_model * m.d_ff * L
    dense_flops = 6 * m.tokens * (m.dense_params + m.vocab_size * m.d_model)  # head GEMM
    expert_rate = r.stream_flops_per_s if mode != "device" and r.stream_flops_per_s \
        else r.flops_per_s                              # the streamed walk's own rate
    mb = m.micro_batches
    path = _Path()
    compute = path.serial(0.0, {"dense compute": mb * dense_flops / r.flops_per_s,
                                "expert compute": mb * flops / expert_rate})
    used = min(E, m.tokens * m.top_k)
    slots = (2 + lookahead) * copy_bytes + copy_bytes   # rotating slots + one gradient
    # the host store's records: fp32 ones keep their gradient row; a compact one holds an
    # expert's gradient from its backward to its step (all of them at once when deferred)
    grad_kept = m.state.exact or step_mode == "deferred" or m.micro_batches > 1
    host_state = L * E * sum(m.state.row_bytes(pos, P) for pos in range(3 + grad_kept))
    parts = dict(compute_s=compute)
    if mode == "device":
        device, host, disk = dense + L * E * state_bytes, 0, 0
        adam = L * E * P / r.device_adam_params_per_s
        parts["device_adam_s"] = adam
        step = path.serial(compute, {"device AdamW": adam})
    else:
        pinned = int(pin_fraction * E) if mode == "pin" else 0
        device = dense + L * pinned * copy_bytes + slots
        streamed = max(used - pinned, 0)
        upload = mb * L * streamed * 2 * copy_bytes / r.h2d_bytes_per_s
        download = mb * L * used * copy_bytes / r.d2h_bytes_per_s
        adam = L * E * P / r.adam_params_per_s
        parts.update(upload_s=upload, download_s=download, host_adam_s=adam)
        transfers = {"uploads": upload, "gradient downloads": download}
        deferred_overlap = r.overlap and step_mode == "deferred"
        if not r.overlap:               # a CPU "device": copies and AdamW share the cores;
            # AdamW on the engine's workers (optimizer.worker_layout: two on the disk tier)
            workers = worker_layout(False, step_mode, mode == "disk")[1]
            step = path.serial(compute, {**transfers, "host AdamW": adam / workers})
        elif step_mode == "eager":      # max(compute, transfers, adam)
            step = path.beside(path.beside(compute, transfers), {"host AdamW": adam})
        else:                           # max(compute, transfers) + adam
            step = path.beside(compute, transfers)
            if mode != "disk":
                step = path.serial(step, {"host AdamW": adam})
        if mode == "disk":
            cache = b.host_cache_bytes if b.host_cache_bytes is not None else b.host_bytes // 2
            disk = L * E * m.geometry().total      # files hold all four rows
            host = min(cache, disk)
            read, write = disk_traffic(m, cache, step_mode)
            read_s, write_s = disk_seconds(read, write, r)
            parts.update(disk_s=read_s + write_s, disk_read_bytes_per_step=read,
                         disk_write_bytes_per_step=write, disk_bytes_per_step=read + write)
            if deferred_overlap:        # max(compute, transfers, reads) + max(adam, writes)
                step = path.beside(step, {"disk reads": read_s})
                step += path.beside(path.serial(0.0, {"host AdamW": adam}),
                                    {"disk writes": write_s})
            else:                       # the disk's threads beside all of it
                step = path.beside(step, {"disk reads": read_s, "disk writes": write_s})
        else:
            host, disk = host_state, 0
    fits = device <= b.device_bytes and host <= b.host_bytes and disk <= b.disk_bytes
    return ModeEstimate(mode, int(device), int(host), int(disk), fits, step, parts,
                        path.table())


def plan(m: ModelSpec, b: Budgets, r: Rates, **kw) -> tuple[list[ModeEstimate], str | None]:
    """Every mode's estimate and the pick: the fastest that fits; among equally fast ones (to
    the microsecond) the one using the least device memory, then the simpler."""
    ests = [estimate(m, b, r, mode, **kw) for mode in MODES]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        return ests, None
    best = min(fitting, key=lambda e: (round(e.step_s, 6), e.device_bytes,
                                       MODES.index(e.mode)))
    return ests, best.mode


def largest_experts(m: ModelSpec, b: Budgets, r: Rates, mode: str, limit: int = 1 << 20,
                    **kw) -> int:
    """The largest expert count per layer whose memory fits in `mode` (0 if none)."""
    def fits(num):
        spec = ModelSpec(**{**asdict(m), "num_experts": num, "dense_params": m.dense_params})
        return estimate(spec, b, r, mode, **kw).fits
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"

