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
  upload   = experts_used * 2 (forward + backward) * P * itemsize / h2d_bytes_per_s
  download = experts_used * P * itemsize / d2h_bytes_per_s   (gradients)
  adam     = E * P / adam_params_per_s                       (host AdamW over all experts)
  disk     = E * 16 P / disk_read + E * 16 P / disk_write     (each record in and out once)
(compute, transfers and disk once per micro-batch, adam once per step), and the step is
max(compute, transfers, adam in eager mode, disk) (the pipeline overlaps them)
plus adam in deferred mode, plus the dense compute. `experts_used` is min(E, tokens * top_k)
(an expert with no tokens is never uploaded). The device mode pays compute + device AdamW.

`Rates` are measured (`measure_rates()` on this machine) or given. `largest_experts()` finds,
for each mode, the largest expert count whose memory fits the budgets.

Deliberately not here: activation recomputation/offload in the estimate (policy `keep`
assumed), multi-device placement, the all-to-all.

Legend: E experts per layer, P parameters of one expert.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

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

    def __post_init__(self) -> None:
        for name in ("moe_layers", "d_model", "d_ff", "num_experts", "top_k", "tokens",
                     "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype={self.dtype!r} is unknown; use one of {', '.join(ITEMSIZE)}")
        if self.dense_params is None:
            self.dense_params = self.moe_layers * (4 * self.d_model ** 2 +
                                                   self.d_model * self.num_experts)

    @property
    def expert_params(self) -> int:
        return (3 if self.glu else 2) * self.d_model * self.d_ff

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


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


# ES-MoE's machines: A100-40GB (bf16 ~ 150 TFLOP/s achieved), PCIe 4 x16 (~20 GB/s), a fast
# NVMe SSD (~3 GB/s read, ~2 GB/s write), host AdamW on many cores (~1.5 G params/s).
A100_NODE = Rates(flops_per_s=150e12, h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9,
                  adam_params_per_s=1.5e9, device_adam_params_per_s=50e9,
                  disk_read_bytes_per_s=3e9, disk_write_bytes_per_s=2e9)


@dataclass
class ModeEstimate:
    mode: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    fits: bool
    step_s: float
    parts: dict


def _activation_bytes(m: ModelSpec) -> int:
    rows = m.tokens * m.top_k
    per_layer = m.tokens * m.d_model + rows * m.d_ff * (2 if m.glu else 1) + rows * 16
    return m.moe_layers * per_layer * m.itemsize


def estimate(m: ModelSpec, b: Budgets, r: Rates, mode: str, *, step_mode: str = "eager",
             pin_fraction: float = 0.25, lookahead: int = 1) -> ModeEstimate:
    """Memory per tier and predicted step time of one mode."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    P, E, L = m.expert_params, m.num_experts, m.moe_layers
    copy_bytes = P * m.itemsize                        # one expert in compute precision
    state_bytes = 16 * P + (0 if m.itemsize == 4 else copy_bytes)
    dense = m.dense_params * (16 + (0 if m.itemsize == 4 else m.itemsize)) + _activation_bytes(m)
    flops = 3 * 2 * m.tokens * m.top_k * (3 if m.glu else 2) * m.d_model * m.d_ff * L
    dense_flops = 6 * m.tokens * m.dense_params
    compute = (flops + dense_flops) / r.flops_per_s
    used = min(E, m.tokens * m.top_k)
    slots = (2 + lookahead) * copy_bytes + copy_bytes   # rotating slots + one gradient
    host_state = L * E * 16 * P
    mb = m.micro_batches
    compute *= mb
    parts = dict(compute_s=compute)
    if mode == "device":
        device, host, disk = dense + L * E * state_bytes, 0, 0
        adam = L * E * P / r.device_adam_params_per_s
        parts["device_adam_s"] = adam
        step = compute + adam
    else:
        pinned = int(pin_fraction * E) if mode == "pin" else 0
        device = dense + L * pinned * copy_bytes + slots
        streamed = max(used - pinned, 0)
        upload = mb * L * streamed * 2 * copy_bytes / r.h2d_bytes_per_s
        download = mb * L * used * copy_bytes / r.d2h_bytes_per_s
        adam = L * E * P / r.adam_params_per_s
        parts.update(upload_s=upload, download_s=download, host_adam_s=adam)
        overlapped = [compute, upload + download]
        if mode == "disk":
            cache = b.host_cache_bytes if b.host_cache_bytes is not None else b.host_bytes // 2
            host, disk = min(cache, host_state), host_state
            resident_records = min(L * E, cache // (16 * P))
            moved = mb * (L * E - resident_records) * 16 * P
            parts["disk_s"] = moved / r.disk_read_bytes_per_s + moved / r.disk_write_bytes_per_s
            parts["disk_bytes_per_step"] = 2 * moved
            overlapped.append(parts["disk_s"])
        else:
            host, disk = host_state, 0
        if not r.overlap:
            step = sum(overlapped) + adam
        elif step_mode == "eager":
            overlapped.append(adam)
            step = max(overlapped)
        else:
            step = max(overlapped) + adam
    fits = device <= b.device_bytes and host <= b.host_bytes and disk <= b.disk_bytes
    return ModeEstimate(mode, int(device), int(host), int(disk), fits, step, parts)


def plan(m: ModelSpec, b: Budgets, r: Rates, **kw) -> tuple[list[ModeEstimate], str | None]:
    """Every mode's estimate and the pick: the fastest that fits (ties: the simpler)."""
    ests = [estimate(m, b, r, mode, **kw) for mode in MODES]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        return ests, None
    best = min(fitting, key=lambda e: (round(e.step_s, 9), MODES.index(e.mode)))
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


def measure_host_adam() -> float:
    """Host AdamW rate (parameters per second) of this machine: one fused step of 4M."""
    p, g = torch.randn(1 << 22), torch.randn(1 << 22)
    m1, m2, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())
    from torch.optim.adamw import adamw
    kw = dict(foreach=False, fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
              weight_decay=0.01, eps=1e-8, maximize=False)
    adamw([p], [g], [m1], [m2], [], [step], **kw)
    start = time.perf_counter()
    adamw([p], [g], [m1], [m2], [], [step], **kw)
    return p.numel() / (time.perf_counter() - start)


def measure_rates(disk_dir: str | None = None, size_mb: int = 64) -> Rates:
    """Measure this machine: fp32 GEMM rate, memory copy bandwidth (the simulated device's
    link), host AdamW rate, and disk read/write bandwidth (fsynced writes; reads of a file just
    written may come from the page cache, so this is an upper bound)."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start = time.perf_counter()
    reps = 4
    for _ in range(reps):
        torch.mm(a, b)
    flops = reps * 2 * n ** 3 / (time.perf_counter() - start)
    src = torch.randn(size_mb << 18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    copy_bw = src.numel() * 4 / (time.perf_counter() - start)
    adam = measure_host_adam()
    with tempfile.TemporaryDirectory(dir=disk_dir) as d:
        path = os.path.join(d, "probe.bin")
        data = memoryview(src.numpy()).cast("B")
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write_bw = len(data) / (time.perf_counter() - start)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(dst.numpy()).cast("B"))
        read_bw = len(data) / (time.perf_counter() - start)
    return Rates(flops_per_s=flops, h2d_bytes_per_s=copy_bw, d2h_bytes_per_s=copy_bw,
                 adam_params_per_s=adam, device_adam_params_per_s=adam,
                 disk_read_bytes_per_s=read_bw, disk_write_bytes_per_s=write_bw,
                 overlap=torch.cuda.is_available())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"

