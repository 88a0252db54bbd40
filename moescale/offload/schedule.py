"""AccessSchedule: the disk tier's knowledge of what comes next, for eviction and read-ahead.

A list of accesses `(key, rows)` in the order they will happen (set after routing: the
forward's master rows, then backward's records in reverse; the host optimizer's queued work
first). Each access of a key consumes that key's first remaining entry, wherever it stands;
`next_use(key)` is the position of its next entry (infinity if none: Belady's rule evicts it
first), `first_uses()` the entries still ahead, each key once, in order. Positions are
absolute, so they compare across calls. Not thread-safe: the disk tier holds its lock.

Deliberately not here: what is read or evicted (disk_tier.py).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterator

Key = tuple[int, int]


class AccessSchedule:
    """The coming accesses (key, rows), consumed key by key."""

    def __init__(self) -> None:
        self._accesses: list[tuple[Key, int]] = []
        self._head = 0
        self._uses: dict[Key, deque[int]] = {}

    def set(self, accesses: list[tuple[Key, int]]) -> None:
        self._accesses, self._head, self._uses = list(accesses), 0, {}
        for i, (key, _) in enumerate(self._accesses):
            self._uses.setdefault(key, deque()).append(i)

    def pending(self) -> list[tuple[Key, int]]:
        """The accesses not consumed yet, in order."""
        return [a for i, a in enumerate(self._accesses[self._head:], self._head)
                if i in self._uses.get(a[0], ())]

    def consume(self, key: Key) -> None:
        """An access of key happened: its first remaining entry is done."""
        uses = self._uses.get(key)
        if uses:
            uses.popleft()
        while self._head < len(self._accesses):
            k = self._accesses[self._head][0]
            if self._uses.get(k) and self._uses[k][0] == self._head:
                break
            self._head += 1

    def next_use(self, key: Key) -> float:
        uses = self._uses.get(key)
        return uses[0] if uses else math.inf

    def first_uses(self) -> Iterator[tuple[int, Key, int]]:
        """(position, key, rows) of each key's next access, in order."""
        seen: set[Key] = set()
        for i in range(self._head, len(self._accesses)):
            key, rows = self._accesses[i]
            if key not in seen and self._uses.get(key) and self._uses[key][0] == i:
                seen.add(key)
                yield i, key, rows
