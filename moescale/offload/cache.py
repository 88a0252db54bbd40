"""DeviceCache: compute-precision copies of experts on the device, within its byte budget.

`walk(layer, order)` yields `(expert, flat_P)` for the experts of `order` one after another:
the copy of expert i+1 (and further, up to `lookahead`) is uploaded while expert i computes, as
far as the device budget allows (an upload that does not fit is simply issued later, when the
previous expert's slot is freed: look-ahead degrades, the budget is never exceeded). A slot is
freed as soon as the caller moves on to the next expert, unless the expert is pinned or
retained.

Retention (a chunked walk, chunked.py, holds each expert once per chunk, in snake order):
when the caller moves past an expert that `order` holds again later, its copy stays on the
device and that later position uses it with no upload (`num_reused`; the disk tier's schedule
is told the read will not happen, `ExpertStore.skip_access`). Retained copies are only ever
taking room nothing else wants: before a look-ahead upload that does not fit, those used after
the look-ahead's target are dropped, the one used last first (Belady); before a blocking
upload, and before yielding an expert in a walk with `headroom` (the gradient's room), as many
as it takes for the reservation to succeed without waiting on them; at the walk's end all of
them. So the budget is never exceeded, look-ahead is never traded for retention, and no
blocking reservation waits on a copy only the walk itself could free. A retained copy is used
only if its master has not moved on since (`_current`: the version the copy was made of, no
step queued); within a walk nothing steps an expert before its last position (forward: none;
eager backward: at its last chunk), so this check only guards the invariant. The numbers do
not change: a reused copy is the upload it replaces.

Pinning (ES-MoE pins the hottest 25%): `observe(layer, counts)` keeps an EMA of each expert's
token count; `repin()` (once per iteration) keeps the `pin_fraction` hottest experts of each
layer resident, as far as the budget leaves room for the rotating slots. A pinned copy is
re-uploaded when the optimizer has stepped its master (its version moved on).

Every upload waits on the host optimizer's step fence for that expert first, on the copy
thread: the device never reads a master whose step is still running.

Borrowing (`borrow = True`, set by generation on a CPU device when the store's masters are
fp32 and so is compute): a walk's "copy" is the store's master row itself (a disk-tier slot
or the host tier's row), acquired when compute first needs it (the disk tier's read-ahead has
started its read already) and released when the walk moves on, instead of copied within RAM.
Only for walks whose experts nothing steps meanwhile (no_grad generation).

Waiting is measured where it happens: from the moment compute needs the next expert of a walk
(the walk starts, or the caller comes back for the next one) until its copy is usable, on the
device's stall clock (devices.py: the caller's thread on the simulated device, the compute
stream's timing events on CUDA), plus the caller's own disk-tier record reads outside walks
(`ExpertStore.thread_read_wait_s`). `take_wait_s()` hands a training step its share.

Deliberately not here: activations (experts.py), the store's own disk cache (store.py).

Legend: P parameters of one expert.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from moescale.devices import Reservation, Transfer
from moescale.offload.optimizer import HostOptimizer
from moescale.offload.store import ExpertStore, Key


@dataclass
class _Entry:
    key: Key
    reservation: Reservation
    transfer: Transfer
    version_box: list = field(default_factory=list)  # the store version the copy was made of
    pinned: bool = False
    tensor_P: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.tensor_P is None:
            (self.tensor_P,) = self.transfer.wait()
        return self.tensor_P

    def free(self) -> None:
        """Drop the copy (give a borrowed master back to the store) and its reservation."""
        self.tensor_P = None
        if isinstance(self.transfer, _Borrow):
            self.transfer.give_back()
        self.reservation.release()


class _Borrow:
    """A transfer whose result is the store's master row itself (see Borrowing above)."""

    def __init__(self, prepare) -> None:
        self.prepare, self.done = prepare, None

    def wait(self) -> list[torch.Tensor]:
        tensors, self.done = self.prepare()
        return tensors

    def give_back(self) -> None:
        if self.done is not None:
            self.done()
            self.done = None


def _next_uses(keys: list) -> list[float]:
    """For each position of keys, the next position holding the same key (inf if none)."""
    out, seen = [math.inf] * len(keys), {}
    for i in range(len(keys) - 1, -1, -1):
        out[i] = seen.get(keys[i], math.inf)
        seen[keys[i]] = i
    return out


class DeviceCache:
    """Rotating + pinned expert copies on `device`, fetched from `store`."""

    def __init__(self, device, store: ExpertStore, optimizer: HostOptimizer,
                 dtype: torch.dtype, *, lookahead: int = 1, pin_fraction: float = 0.0,
                 ema_decay: float = 0.9) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead={lookahead!r} must be >= 0")
        if not 0.0 <= pin_fraction <= 1.0:
            raise ValueError(f"pin_fraction={pin_fraction!r} must be in [0, 1]")
        self.device, self.store, self.optimizer, self.dtype = device, store, optimizer, dtype
        self.lookahead, self.pin_fraction, self.ema_decay = lookahead, pin_fraction, ema_decay
        self._pinned: dict[Key, _Entry] = {}
        self.ema: dict[Key, float] = {}
        self.num_uploads = 0
        self.num_lookahead = 0
        self.num_reused = 0       # walk positions served by a retained copy (no upload)
        self.retain = True        # False: every copy freed when the caller moves on (tests)
        self.borrow = False       # walks use the store's master rows in place (see above)
        self._walk_reads: dict[int, float] = {}   # per thread: its store reads inside walks
        self._taken = 0.0         # wait_seconds at the last take_wait_s()

    @property
    def wait_seconds(self) -> float:
        """Seconds compute has waited for experts so far: the device's stalls in walks (until
        the next expert's copy was usable: its optimizer fence, the store's read, the upload),
        plus the caller's thread's own disk-tier record reads outside walks (e.g. the
        gradient-norm pass, gradients added to the records)."""
        inside = self._walk_reads.get(threading.get_ident(), 0.0)   # in the stalls already
        outside = self.store.thread_read_wait_s() - inside
        return self.device.stalled_s() + outside

    def take_wait_s(self) -> float:
        """wait_seconds since the previous take (a training step's share; call it on the
        step's thread)."""
        now = self.wait_seconds
        waited, self._taken = now - self._taken, now
        return max(0.0, waited)

    def expert_bytes(self, layer: int) -> int:
        return self.store.layouts[layer].numel * torch.empty((), dtype=self.dtype).element_size()

    # ----------------------------------------------------------------- uploads
    def _start(self, key: Key, block: bool, headroom: int = 0,
               whole_record: bool = False, borrow: bool = False) -> _Entry | None:
        """Reserve and start an upload of key; None when it (plus headroom bytes) does not
        fit and block=False. whole_record: load the store's whole record (its gradient is
        about to be accumulated), not just the master row."""
        nbytes = self.expert_bytes(key[0])
        if not block and not self.device.fits(nbytes + headroom):
            return None
        reservation = self.device.reserve(nbytes, f"expert {key}", block=block)
        store, optimizer = self.store, self.optimizer
        version_box = []

        def prepare():
            optimizer.wait_step(key)  # the per-expert fence
            version_box.append(store.versions[key])
            if whole_record:
                return [store.acquire(key).master_P], lambda: store.release(key)
            master_P, done = store.read_master(key)
            return [master_P], done

        self.num_uploads += 1
        transfer = _Borrow(prepare) if borrow and not whole_record else \
            self.device.upload_from(prepare, self.dtype)
        return _Entry(key, reservation, transfer, version_box)

    def _current(self, entry: _Entry) -> bool:
        """Whether a finished copy is of the master as it is now (its version has not moved on
        and no step of it is queued or running)."""
        fence = self.optimizer.step_fence(entry.key)
        return entry.version_box[0] == self.store.versions[entry.key] and \
            (fence is None or fence.done())

    def _valid_pinned(self, key: Key) -> _Entry | None:
        entry = self._pinned.get(key)
        if entry is None:
            return None
        entry.wait()
        return entry if self._current(entry) else None

    def _refresh_pinned(self, key: Key) -> _Entry:
        """Re-upload a stale pinned expert into its existing reservation."""
        old = self._pinned[key]
        old.wait()
        old.reservation.release()
        entry = self._start(key, block=True)
        entry.pinned = True
        self._pinned[key] = entry
        return entry

    def is_resident(self, key: Key) -> bool:
        return key in self._pinned

    # ----------------------------------------------------------------- the walk
    def walk(self, layer: int, order, headroom: int = 0, whole_record: bool = False):
        """Yield (expert, weights_P) for each expert of `order`, uploads overlapped. A
        look-ahead upload is issued only if it leaves `headroom` bytes free (backward keeps
        room for the current expert's gradient and sets whole_record: the disk tier then
        caches the record the gradient goes to, instead of reading the master twice). An
        expert that `order` holds again later keeps its copy while the budget allows
        (retention, see the module docstring)."""
        order = list(order)
        keys = [(layer, e) for e in order]
        later = _next_uses(keys)
        device = self.device
        pending: deque[tuple[int, _Entry]] = deque()      # (position in order, its copy)
        kept: dict[Key, tuple[float, _Entry]] = {}         # retained: (next use, copy)
        nxt = 0

        def drop(key: Key) -> None:
            kept.pop(key)[1].free()

        def room(nbytes: int, before: float, now: bool) -> bool:
            """Drop retained copies, the one used last first and none used at `before` or
            earlier, until nbytes fit now (now=False: once other threads' async reservations
            are released, so that a blocking reservation never waits on a retained copy);
            False, dropping none, if they cannot."""
            fits = device.fits if now else device.fits_eventually
            victims, freed = [], 0
            for key in sorted(kept, key=lambda k: -kept[k][0]):
                if fits(nbytes - freed) or kept[key][0] <= before:
                    break
                victims.append(key)
                freed += kept[key][1].reservation.nbytes
            if not fits(nbytes - freed):
                return False
            for key in victims:
                drop(key)
            return True

        def issue():
            nonlocal nxt
            while nxt < len(order) and len(pending) < 1 + self.lookahead:
                key = keys[nxt]
                if key in self._pinned:
                    entry = self._valid_pinned(key) or self._refresh_pinned(key)
                elif any(keys[p] == key for p, _ in pending):
                    return   # in use: retained (then reused) once the caller moves past it
                elif key in kept and self._current(kept[key][1]):
                    self.num_reused += 1
                    self.store.skip_access(key)      # the master is not read for this one
                    pending.append((nxt, kept.pop(key)[1]))
                    nxt += 1
                    continue
                else:
                    if key in kept:
                        drop(key)     # never reached (no step within a walk): stay correct
                    need = self.expert_bytes(layer) + headroom
                    if pending and not room(need, nxt, now=True):
                        return
                    if not pending and not room(need, -1, now=False):
                        for k in list(kept):
                            drop(k)
                    entry = self._start(key, block=not pending,
                                        headroom=headroom if pending else 0,
                                        whole_record=whole_record, borrow=self.borrow)
                    if entry is None:
                        return
                if pending:
                    self.num_lookahead += 1  # issued while an earlier expert is computing
                pending.append((nxt, entry))
                nxt += 1

        reads, me = self.store.thread_read_wait_s, threading.get_ident()
        stall, read0 = device.stall_begin(), reads()   # compute needs order[0] from now on
        try:
            issue()
            while pending:
                pos, entry = pending[0]
                if headroom and not room(headroom, -1, now=False):   # the gradient's room
                    for k in list(kept):
                        drop(k)
                weights_P = entry.wait()
                device.stall_end(stall)
                if reads() != read0:     # CUDA: prepare() read on this thread, in the stall
                    self._walk_reads[me] = self._walk_reads.get(me, 0.0) + reads() - read0
                try:
                    yield order[pos], weights_P
                finally:
                    pending.popleft()
                    if entry.pinned:
                        pass
                    elif later[pos] < math.inf and self.retain:
                        kept[keys[pos]] = (later[pos], entry)   # used again: retain
                    else:
                        entry.free()
                del weights_P
                stall, read0 = device.stall_begin(), reads()   # the caller's compute is queued
                issue()
        finally:
            for key in list(kept):
                drop(key)
            for _, entry in pending:    # a walk closed early: its look-ahead copies
                if not entry.pinned:
                    entry.free()

    # ----------------------------------------------------------------- hot experts
    def observe(self, layer: int, counts) -> None:
        d = self.ema_decay
        for e, n in enumerate(counts):
            key = (layer, e)
            self.ema[key] = d * self.ema.get(key, float(n)) + (1 - d) * n

    def repin(self, reserve_rotating: int) -> None:
        """Pin the hottest pin_fraction of each layer's experts while the budget keeps room
        for `reserve_rotating` rotating slots of the largest expert."""
        if self.pin_fraction <= 0:
            return
        want: list[Key] = []
        for layer, num in enumerate(self.store.num_experts):
            hot = sorted(range(num), key=lambda e: -self.ema.get((layer, e), 0.0))
            want += [(layer, e) for e in hot[:int(self.pin_fraction * num)]]
        for key in list(self._pinned):
            if key not in want:
                entry = self._pinned.pop(key)
                entry.wait()
                entry.reservation.release()
        budget = self.device.budget_bytes
        rotating = reserve_rotating * max(self.expert_bytes(lay) for lay in
                                          range(len(self.store.layouts)))
        for key in want:
            if key in self._pinned:
                continue
            nbytes = self.expert_bytes(key[0])
            if budget is not None and self.device.used_bytes + nbytes + rotating > budget:
                break
            entry = self._start(key, block=False)
            if entry is None:
                break
            entry.pinned = True
            self._pinned[key] = entry

    def clear(self) -> None:
        for entry in self._pinned.values():
            entry.wait()
            entry.reservation.release()
        self._pinned.clear()
