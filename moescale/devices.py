"""The device abstraction used by offloading: a real CUDA accelerator or a simulated one.

Offloading moves expert weights between a host store and a small device cache. It needs four
things from a device, and nothing else:

- byte accounting: `reserve(nbytes, what)` returns a `Reservation` handle charged to the budget
  until `release()` (idempotent; a weakref finalizer releases a handle that is dropped without
  it, so accounting can never leak). A request past the budget raises `DeviceBudgetError`
  naming the budget, the bytes in use and the request. `used_bytes` / `peak_bytes` are exact;
  `fits(nbytes)`: would a reservation succeed now; `fits_eventually(nbytes)`: would a blocking
  one (once the reservations other threads release are released);
- `upload(host_tensors, dtype, reservation)` -> `Transfer`: host -> device copies cast to the
  compute dtype, issued asynchronously; `Transfer.wait()` returns the device tensors once they
  may be read by the caller's compute;
- `download(device_tensor)` -> `Transfer` of a host copy (gradients, offloaded activations);
- `tensor_device`: where compute runs (`cpu` for the simulated device);
- a stall clock: `stall_begin()` -> token, `stall_end(token)` around a stretch in which compute
  waits for offloaded data, and `stalled_s()`, the seconds of every stretch ended so far. The
  simulated device times the caller's thread (perf_counter); CUDA times the compute stream with
  timing events (the stretch the stream spent between the two events: waiting on a copy's
  event, or idle while the host prepared it), resolved when `stalled_s()` is read.

`SimulatedDevice(budget_bytes)` stands in for accelerator memory on CPU-only machines: device
tensors are CPU tensors, every reservation is charged to the budget, and copies run on one
worker thread (torch releases the GIL in copies, so the overlap with compute is real). Upload
copies go into storages the device keeps (as many per size as the budget holds) once nothing
else holds them (layers/grad_buffers.py): an expert upload of tens of MiB would otherwise come
from fresh kernel pages, faulted in at every copy. An
optional `bandwidth_bytes_per_s` throttles copies like a PCIe link, for benchmarks.

`CudaDevice` uses a side stream for copies, pinned host memory, non_blocking copies, events that
the compute stream waits on, and `record_stream` so the caching allocator never reuses a buffer
the other stream still reads. It only touches CUDA when constructed. It is not exercised on
this CPU-only machine; it is kept small so that it is obviously right.

Deliberately not here: allocation of activations or dense parameters (only the offloading
machinery charges the budget), multi-device placement.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from moescale.layers.grad_buffers import GradBuffers
from moescale.sizes import fmt_bytes


class DeviceBudgetError(MemoryError):
    """A device reservation would exceed the device byte budget."""


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Ledger:
    """Thread-safe byte counter with a budget and a peak; the single source of truth.

    `async_bytes` are held by reservations that another thread will release (e.g. gradients
    handed to the host optimizer); a blocking charge waits for those, and only for those.
    """

    def __init__(self, budget_bytes: int | None, name: str) -> None:
        self.budget_bytes, self.name = budget_bytes, name
        self.used_bytes = 0
        self.async_bytes = 0
        self.peak_bytes = 0
        self.lock = threading.Lock()
        self.freed = threading.Condition(self.lock)

    def charge(self, nbytes: int, what: str, block: bool, async_release: bool) -> None:
        with self.lock:
            while self.budget_bytes is not None and \
                    self.used_bytes + nbytes > self.budget_bytes:
                can_wait = self.used_bytes - self.async_bytes + nbytes <= self.budget_bytes
                if not (block and can_wait):
                    raise DeviceBudgetError(
                        f"{self.name}: reserving {fmt_bytes(nbytes, exact=True)} for {what} "
                        f"exceeds the device budget of {fmt_bytes(self.budget_bytes, exact=True)} "
                        f"({fmt_bytes(self.used_bytes, exact=True)} in use); raise the device "
                        "budget, or lower the look-ahead / pinned experts")
                self.freed.wait()
            self.used_bytes += nbytes
            self.async_bytes += nbytes if async_release else 0
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            assert self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def uncharge(self, nbytes: int, async_release: bool) -> None:
        with self.lock:
            self.used_bytes -= nbytes
            self.async_bytes -= nbytes if async_release else 0
            assert self.used_bytes >= 0 and self.async_bytes >= 0, \
                "device ledger released more than it charged"
            self.freed.notify_all()

    def fits_now(self, nbytes: int) -> bool:
        with self.lock:
            return self.budget_bytes is None or self.used_bytes + nbytes <= self.budget_bytes

    def fits_eventually(self, nbytes: int) -> bool:
        with self.lock:
            return self.budget_bytes is None or \
                self.used_bytes - self.async_bytes + nbytes <= self.budget_bytes


class Reservation:
    """Bytes charged to a device until `release()`; released by a finalizer if dropped."""

    def __init__(self, ledger: _Ledger, nbytes: int, what: str, async_release: bool) -> None:
        self.nbytes, self.what = nbytes, what
        self._finalizer = weakref.finalize(self, ledger.uncharge, nbytes, async_release)

    @property
    def active(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()  # runs at most once


class Transfer:
    """An asynchronous copy; `wait()` returns its tensors, ready for the caller's compute."""

    def __init__(self, future: Future, on_wait=None) -> None:
        self._future, self._on_wait = future, on_wait
        self.event = None  # CUDA: the copy's completion event

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> list[torch.Tensor]:
        tensors = self._future.result()
        if self._on_wait is not None:
            self._on_wait(tensors)
        return tensors


class _DeviceBase:
    """Budget accounting shared by both devices."""

    tensor_device: torch.device

    def __init__(self, budget_bytes: int | None, name: str) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 1):
            raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive integer or None "
                             "(no budget)")
        self._ledger = _Ledger(budget_bytes, name)
        self._stalled = 0.0      # seconds of the stall clock's stretches (see the module doc)

    @property
    def budget_bytes(self) -> int | None:
        return self._ledger.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self._ledger.used_bytes

    @property
    def peak_bytes(self) -> int:
        return self._ledger.peak_bytes

    def reset_peak(self) -> None:
        with self._ledger.lock:
            self._ledger.peak_bytes = self._ledger.used_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether a reservation of nbytes would succeed right now."""
        return self._ledger.fits_now(nbytes)

    def fits_eventually(self, nbytes: int) -> bool:
        """Whether a blocking reservation of nbytes would succeed, at once or once the
        reservations marked async_release are released (i.e. it would not raise)."""
        return self._ledger.fits_eventually(nbytes)

    def reserve(self, nbytes: int, what: str = "a buffer", *, block: bool = False,
                async_release: bool = False) -> Reservation:
        """Charge nbytes until the handle's release(). Past the budget: DeviceBudgetError, or
        with block=True a wait for reservations marked async_release (released by other
        threads) when those would make room; never a wait that cannot end."""
        self._ledger.charge(int(nbytes), what, block, async_release)
        return Reservation(self._ledger, int(nbytes), what, async_release)


class SimulatedDevice(_DeviceBase):
    """A device whose memory is a byte budget over CPU tensors; copies on a worker thread."""

    def __init__(self, budget_bytes: int | None, *, bandwidth_bytes_per_s: float | None = None,
                 name: str = "simulated device") -> None:
        super().__init__(budget_bytes, name)
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0 or "
                             "None (copies as fast as memory allows)")
        self.tensor_device = torch.device("cpu")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moescale-copy")
        self._copies = GradBuffers()   # upload copies' storage, reused once dropped
        self.copy_thread_names: set[str] = set()
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0

    @staticmethod
    def stall_begin() -> float:
        return time.perf_counter()

    def stall_end(self, token: float) -> None:
        """Compute waited on this thread since stall_begin() returned `token`."""
        self._stalled += time.perf_counter() - token

    def stalled_s(self) -> float:
        return self._stalled

    def _copy(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None,
              upload: bool) -> list:
        start = time.perf_counter()
        self.copy_thread_names.add(threading.current_thread().name)
        out = []
        for t in tensors:
            dt = dtype if dtype is not None else t.dtype
            if upload:     # into a kept buffer nothing holds any more (no fresh pages)
                nbytes = t.numel() * dt.itemsize
                keep = max(2, (self.budget_bytes or 0) // max(nbytes, 1) + 1)   # budget's copies
                out.append(self._copies.empty(f"{nbytes}", t.shape, dt, keep).copy_(t))
            else:
                out.append(t.to(dtype=dt, copy=True))
        nbytes = sum(tensor_bytes(t) for t in out)
        if upload:
            self.bytes_uploaded += nbytes
        else:
            self.bytes_downloaded += nbytes
        if self.bandwidth_bytes_per_s is not None:
            remaining = nbytes / self.bandwidth_bytes_per_s - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)
        return out

    def upload(self, host_tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None
               ) -> Transfer:
        """Copies (cast to dtype) of host tensors, made on the copy thread."""
        return Transfer(self._pool.submit(self._copy, list(host_tensors), dtype, True))

    def upload_from(self, prepare: Callable[[], tuple[Sequence[torch.Tensor], Callable]],
                    dtype: torch.dtype | None = None) -> Transfer:
        """Like upload, but the copy thread first calls prepare() -> (host tensors, done) (it
        may block: e.g. wait for an optimizer step, read from disk) and calls done() after
        the copy, so the host side may be released."""
        def task():
            tensors, done = prepare()
            try:
                return self._copy(tensors, dtype, True)
            finally:
                done()
        return Transfer(self._pool.submit(task))

    def download(self, device_tensors: Sequence[torch.Tensor]) -> Transfer:
        """Host copies of device tensors, made on the copy thread."""
        return Transfer(self._pool.submit(self._copy, list(device_tensors), None, False))

    def synchronize(self) -> None:
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaDevice(_DeviceBase):
    """A CUDA device: copies on a side stream from pinned memory, fenced by events.

    The budget is the offloading machinery's own ledger (on top of the caching allocator).
    """

    def __init__(self, budget_bytes: int | None, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ValueError("CudaDevice needs CUDA, which this machine lacks; use "
                             "SimulatedDevice(budget_bytes) on CPU-only machines")
        super().__init__(budget_bytes, f"cuda:{index if index is not None else 'current'}")
        self.tensor_device = torch.device("cuda", index if index is not None
                                          else torch.cuda.current_device())
        self.side_stream = torch.cuda.Stream(self.tensor_device)
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self._stalls: list = []     # (begin, end) timing events not read yet

    def _timing_event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.tensor_device))
        return event

    def stall_begin(self):
        return self._timing_event()

    def stall_end(self, token) -> None:
        """The compute stream's stretch from stall_begin's event to now (its wait_event on a
        copy's event, or its idle time while the host prepared the copy)."""
        self._stalls.append((token, self._timing_event()))

    def stalled_s(self) -> float:
        for begin, end in self._stalls:
            end.synchronize()
            self._stalled += begin.elapsed_time(end) / 1000.0
        self._stalls.clear()
        return self._stalled

    def _finish(self, future: Future, tensors: list, event) -> Transfer:
        future.set_result(tensors)

        def on_wait(ts):
            consumer = torch.cuda.current_stream(self.tensor_device)
            consumer.wait_event(event)
            for t in ts:  # the consumer stream now also uses these buffers
                t.record_stream(consumer)
        transfer = Transfer(future, on_wait)
        transfer.event = event
        return transfer

    def upload(self, host_tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None
               ) -> Transfer:
        """Non-blocking copies from (pinned) host memory on the side stream, then the cast."""
        producer = torch.cuda.current_stream(self.tensor_device)
        out = []
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_stream(producer)
            for t in host_tensors:
                d = t.to(self.tensor_device, non_blocking=t.is_pinned())
                out.append(d if dtype is None else d.to(dtype))
                self.bytes_uploaded += tensor_bytes(t)
            event = torch.cuda.Event()
            event.record(self.side_stream)
        return self._finish(Future(), out, event)

    def upload_from(self, prepare: Callable[[], tuple[Sequence[torch.Tensor], Callable]],
                    dtype: torch.dtype | None = None) -> Transfer:
        """prepare() runs here (on the caller's thread); done() once the copy has landed."""
        tensors, done = prepare()
        transfer = self.upload(tensors, dtype)
        on_wait = transfer._on_wait

        def finish(ts):
            on_wait(ts)
            transfer.event.synchronize()  # the host side was read: it may be released
            done()
        return Transfer(transfer._future, finish)

    def download(self, device_tensors: Sequence[torch.Tensor]) -> Transfer:
        """Copies into fresh pinned host buffers; `wait()` blocks until they have landed."""
        producer = torch.cuda.current_stream(self.tensor_device)
        out = []
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_stream(producer)
            for t in device_tensors:
                t.record_stream(self.side_stream)
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                out.append(h)
                self.bytes_downloaded += tensor_bytes(t)
            event = torch.cuda.Event()
            event.record(self.side_stream)
        future: Future = Future()
        future.set_result(out)
        return Transfer(future, lambda ts: event.synchronize())

    def synchronize(self) -> None:
        self.side_stream.synchronize()

    def close(self) -> None:
        self.synchronize()


def make_device(kind: str, budget_bytes: int | None, **options):
    """'cpu' -> SimulatedDevice, 'cuda' -> CudaDevice, 'auto' -> CUDA when available."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return SimulatedDevice(budget_bytes, **options)
    if kind == "cuda":
        return CudaDevice(budget_bytes, **options)
    raise ValueError(f"device={kind!r} is unknown; use 'auto', 'cpu' (simulated) or 'cuda'")
