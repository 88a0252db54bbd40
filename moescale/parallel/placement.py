"""Dynamic expert placement: deterministic greedy LPT over devices, with hot-expert splitting.

Every rank runs `plan_placement` on the same all-gathered counts and gets the same answer (pure
Python on plain numbers: no RNG, ties broken by id), so no rank has to broadcast a decision.

Load model (ES-MoE, extended): placing expert e on device d costs
    rows_e * row_cost  +  (upload_cost if e is not resident in d's cache else 0).
LPT takes experts by decreasing load (ties: lower id first) and gives each to the device with
the least load after the placement (ties: lower device id), skipping devices whose cache already
holds `max_experts_per_device` experts. With `split=True`, an expert whose load alone exceeds
the ideal makespan (total / devices) is first cut into ceil(load / target) near-equal row
shards, which LPT places like experts; if the result is still above (1 + balance_tol) x the
mean, rows are cut off the busiest device's largest shard and moved to the idlest device, at
most 2(D-1) times (split to balance). A split expert's partial gradients are summed before
its step (the caller's job). Caps and affinity take the general greedy path, without the
rebalancing pass. This file only plans: it moves no tensors and calls no collectives.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(kw_only=True)
class PlacementConfig:
    """How experts are assigned to the devices of a node each iteration."""

    num_devices: int
    max_experts_per_device: int | None = None   # cache slots; None: unbounded
    split: bool = False                         # shard experts heavier than the ideal makespan
    row_cost: float = 1.0                       # cost of one row through one expert
    upload_cost: float = 0.0                    # cost of bringing a non-resident expert in
    balance_tol: float | None = 0.02            # split: rebalance while max/mean > 1 + tol

    def __post_init__(self) -> None:
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"num_devices={self.num_devices!r} must be an integer >= 1")
        if self.max_experts_per_device is not None and self.max_experts_per_device < 1:
            raise ValueError(f"max_experts_per_device={self.max_experts_per_device!r} must be "
                             ">= 1 or None (unbounded)")
        if self.row_cost <= 0 or self.upload_cost < 0:
            raise ValueError(f"row_cost={self.row_cost!r} must be > 0 and "
                             f"upload_cost={self.upload_cost!r} >= 0")
        if self.balance_tol is not None and not self.balance_tol >= 0:
            raise ValueError(f"balance_tol={self.balance_tol!r} must be >= 0, or None to "
                             "keep LPT's placement as it is")


class Shard(NamedTuple):
    """Rows [row_start, row_stop) of expert `expert`'s rows this iteration run on `device`."""

    expert: int
    device: int
    row_start: int
    row_stop: int


class Placement:
    """The plan of one iteration: shards in placement order and the modelled device loads.

    `raw_shards` holds plain (expert, device, row_start, row_stop) tuples (cheap to build in
    the hot loop); `shards` gives them as named `Shard`s, `experts_on_device` per device the
    experts it computes (derived on first use).
    """

    __slots__ = ("raw_shards", "device_load", "_held")

    def __init__(self, raw_shards: list[tuple[int, int, int, int]], device_load: list[float],
                 experts_on_device: list[list[int]] | None = None) -> None:
        self.raw_shards, self.device_load, self._held = raw_shards, device_load, \
            experts_on_device

    def __repr__(self) -> str:
        return f"Placement(raw_shards={self.raw_shards!r}, device_load={self.device_load!r})"

    @property
    def experts_on_device(self) -> list[list[int]]:
        if self._held is None:
            held: list[list[int]] = [[] for _ in self.device_load]
            for e, d, _, _ in self.raw_shards:
                held[d].append(e)
            self._held = held
        return self._held

    @property
    def shards(self) -> list[Shard]:
        return [Shard(*s) for s in self.raw_shards]

    @property
    def imbalance(self) -> float:
        """max / mean modelled device load (1.0 is perfect; 1.0 when there is no load)."""
        mean = sum(self.device_load) / len(self.device_load)
        return max(self.device_load) / mean if mean > 0 else 1.0

    def owner_of(self, expert: int) -> list[Shard]:
        return [Shard(*s) for s in self.raw_shards if s[0] == expert]


def plan_placement(counts: list[int], config: PlacementConfig,
                   resident: list[set[int]] | None = None) -> Placement:
    """Assign every expert with rows (and experts without, nowhere) to devices by greedy LPT.

    counts:   rows per expert this iteration (all-gathered and summed over ranks).
    resident: per device, the experts already in its cache (affinity: no upload cost there).

    counts must be integers. Speed: items are ordered by one key sort of indices (stable, so
    ties keep expert and row order); without a cap or affinity the greedy loop is one
    `heapreplace` per item on int keys rows * D + device, with loads kept in rows and scaled
    by row_cost at the end (the same order as scaling each item: row_cost is uniform).
    """
    num_devices = config.num_devices
    if resident is not None and len(resident) != num_devices:
        raise ValueError(f"resident has {len(resident)} entries but num_devices={num_devices}")
    total = sum(counts)
    target = total / num_devices
    order = sorted(range(len(counts)), key=counts.__getitem__, reverse=True)
    fast = config.max_experts_per_device is None and not config.upload_cost
    hot = config.split and bool(order) and counts[order[0]] > target
    rebalance = fast and config.split and config.balance_tol is not None and total > 0
    if fast:
        placement = _lpt_split(order, counts, num_devices, target, config.row_cost) if hot \
            else _lpt_whole(order, counts, num_devices, config.row_cost)
        if rebalance and placement.imbalance > 1 + config.balance_tol:
            _rebalance(placement, counts, config)
        return placement
    items = []
    for e in order:
        n = counts[e]
        if n <= 0:
            break
        items.append((n, e, 0, n))
    if hot:
        items = _split_items(items, target, num_devices)
    return _greedy(items, counts, config, resident)


def _rebalance(placement: Placement, counts, config: PlacementConfig) -> None:
    """Split to balance (in place), at most 2(D-1) moves while max/mean > 1 + balance_tol:
    take the busiest device's largest shard whose expert is missing from some device below
    the mean, and move to the idlest such device as many rows as bring one of the two to the
    mean (water-filling). Items too coarse for LPT (a few experts per device, each near the
    target) are what this fixes; each move adds one shard."""
    num_devices, shards = config.num_devices, placement.raw_shards
    rows = [0] * num_devices
    on_device: list[list[int]] = [[] for _ in range(num_devices)]
    holders: dict[int, set[int]] = {}
    for i, (e, d, a, b) in enumerate(shards):
        rows[d] += b - a
        on_device[d].append(i)
        holders.setdefault(e, set()).add(d)
    mean = sum(rows) / num_devices
    limit = mean * (1 + config.balance_tol)
    for _ in range(2 * (num_devices - 1)):
        hi = max(range(num_devices), key=rows.__getitem__)
        if rows[hi] <= limit:
            break
        best = None
        for i in sorted(on_device[hi], key=lambda j: shards[j][2] - shards[j][3]):
            e, _, a, b = shards[i]
            free = [d for d in range(num_devices) if d not in holders[e]]
            if not free:
                continue
            lo = min(free, key=rows.__getitem__)
            move = min(b - a - 1, round(min(rows[hi] - mean, mean - rows[lo])))
            if move > 0:
                best = (i, lo, move)
                break
        if best is None:
            break
        i, lo, move = best
        e, _, a, b = shards[i]
        shards[i] = (e, hi, a, b - move)
        shards.append((e, lo, b - move, b))
        on_device[lo].append(len(shards) - 1)
        holders[e].add(lo)
        rows[hi] -= move
        rows[lo] += move
    placement.device_load[:] = [n * config.row_cost for n in rows]
    placement._held = None


def _lpt_whole(order, counts, num_devices: int, row_cost: float) -> Placement:
    """The common case (no split, cap or affinity): one heapreplace per expert with rows.
    Heap entries are ints rows * D + device (cheaper to compare than tuples; same order:
    least rows first, ties to the lower device id)."""
    heap = list(range(num_devices))
    shards: list[tuple[int, int, int, int]] = []
    append, heapreplace = shards.append, heapq.heapreplace
    for e in order:
        n = counts[e]
        if n <= 0:
            break
        key = heap[0]
        heapreplace(heap, key + n * num_devices)
        append((e, key % num_devices, 0, n))
    return Placement(shards, _loads(heap, num_devices, row_cost))


def _loads(heap: list[int], num_devices: int, row_cost: float) -> list[float]:
    loads = [0.0] * num_devices
    for key in heap:
        loads[key % num_devices] = key // num_devices * row_cost
    return loads


def _split_items(items, target: float, num_devices: int):
    """Replace the experts heavier than `target` (the first items) by near-equal row pieces,
    merged into the order (rows descending, then expert id, then first row). Given only hot
    experts, returns their pieces in that order."""
    num_hot = 0
    while num_hot < len(items) and items[num_hot][0] > target:
        num_hot += 1
    pieces = []
    for n, e, _, _ in items[:num_hot]:
        parts = min(num_devices, math.ceil(n / target))
        base, extra = divmod(n, parts)
        start = 0
        for i in range(parts):
            size = base + 1 if i < extra else base
            pieces.append((size, e, start, start + size))
            start += size
    pieces.sort(key=_order_key)
    rest = items[num_hot:]
    for piece in reversed(pieces):   # largest last: each insert lands before later ones
        rest.insert(bisect.bisect_left(rest, _order_key(piece), key=_order_key), piece)
    return rest


def _order_key(item):
    return -item[0], item[1], item[2]


def _lpt_split(order, counts, num_devices: int, target: float, row_cost: float) -> Placement:
    """LPT with the hot experts (a prefix of `order`) cut into pieces, without caps or
    affinity: the pieces (few, sorted) are merged into the walk over `order` on the fly, in
    the order (rows descending, expert id, first row); int heap keys as in _lpt_whole;
    pieces of one expert go to distinct devices."""
    num_hot = 0
    while num_hot < len(order) and counts[order[num_hot]] > target:
        num_hot += 1
    pieces = _split_items([(counts[e], e, 0, counts[e]) for e in order[:num_hot]], target,
                          num_devices)
    heap = list(range(num_devices))
    shards: list[tuple[int, int, int, int]] = []
    append, heapreplace = shards.append, heapq.heapreplace
    devices_of: dict[int, list[int]] = {}

    def place_piece(piece) -> None:
        size, e, start, stop = piece
        taken = devices_of.setdefault(e, [])
        aside = []
        while heap[0] % num_devices in taken:   # at most D - 1 pieces are placed
            aside.append(heapq.heappop(heap))
        key = heap[0]
        heapreplace(heap, key + size * num_devices)
        for entry in aside:
            heapq.heappush(heap, entry)
        taken.append(key % num_devices)
        append((e, key % num_devices, start, stop))

    p, num_pieces = 0, len(pieces)
    next_size = pieces[0][0]
    for e in order[num_hot:]:
        n = counts[e]
        if n <= 0:
            break
        while next_size >= n and (next_size > n or pieces[p][1] < e):
            place_piece(pieces[p])
            p += 1
            next_size = pieces[p][0] if p < num_pieces else -1
        key = heap[0]
        heapreplace(heap, key + n * num_devices)
        append((e, key % num_devices, 0, n))
    for piece in pieces[p:]:
        place_piece(piece)
    return Placement(shards, _loads(heap, num_devices, row_cost))


def _greedy(items, counts, config: PlacementConfig, resident) -> Placement:
    """LPT with a heap of (load, device); ties go to the lower device id."""
    num_devices, cap, upload = config.num_devices, config.max_experts_per_device, config.upload_cost
    row_cost = config.row_cost
    loads = [0.0] * num_devices
    held: list[list[int]] = [[] for _ in range(num_devices)]
    heap = [(0.0, d) for d in range(num_devices)]
    resident_on: dict[int, list[int]] = {}
    if upload and resident is not None:
        for d, experts in enumerate(resident):
            for e in experts:
                resident_on.setdefault(e, []).append(d)
    shards: list[tuple[int, int, int, int]] = []
    devices_of: dict[int, list[int]] = {}
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for rows, e, start, stop in items:
        neg_load = -rows * row_cost
        piece = stop - start < counts[e]
        taken, aside = (devices_of.setdefault(e, []), []) if piece else ((), ())
        while piece and heap and heap[0][1] in taken:
            aside.append(heappop(heap))
        if not heap:
            raise ValueError(
                f"no device can take expert {e}: every device holds "
                f"max_experts_per_device={cap} experts; raise the cap or add devices")
        load, best = heap[0]
        best_cost = load - neg_load
        if upload:
            homes = resident_on.get(e, ())
            if best not in homes:
                best_cost += upload
            for d in homes:
                cost = loads[d] - neg_load
                if d not in taken and (cap is None or len(held[d]) < cap) and \
                        (cost, d) < (best_cost, best):
                    best, best_cost = d, cost
        loads[best] = best_cost
        held[best].append(e)
        full = cap is not None and len(held[best]) >= cap
        if heap[0][1] != best:
            heap.remove((_heap_entry(heap, best), best))
            heapq.heapify(heap)
            if not full:
                heappush(heap, (best_cost, best))
        elif full:
            heappop(heap)
        else:
            heapreplace(heap, (best_cost, best))
        if piece:
            taken.append(best)
            for entry in aside:
                heappush(heap, entry)
        shards.append((e, best, start, stop))
    return Placement(raw_shards=shards, device_load=loads, experts_on_device=held)


def _heap_entry(heap, device: int) -> float:
    """The load recorded in the heap for `device` (used only when affinity overrides LPT)."""
    return next(load for load, d in heap if d == device)
