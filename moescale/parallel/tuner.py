"""Online chunk-count tuner for the pipelined all-to-all (MPipeMoE's adaptive granularity).

Per token-count bucket (the bit length of the largest row count of any rank in the EP group),
the tuner first runs `warmup` calls at one chunk without recording them (the first steps of a
process pay for allocator growth, connection set-up and cold caches, and would bias whichever
candidate came first), then tries the candidates round-robin, `trials` measurements each
(round-robin, not one candidate after the other, so that a drift in background load hits every
candidate alike), then keeps the one with the smallest median forward+backward time (the
median resists the occasional slow step that other processes cause). 1 is always a
candidate, so pipelining never loses to not pipelining by more than the measurement noise.

Under a memory limit the dispatcher passes `allowed`: the chunk counts at which some strategy
fits (`memory_model.chunks_that_fit`; a count beyond the candidates when none of them does).
The tuner then warms up at the fewest allowed chunks and explores and picks among the allowed
counts only, so it never runs a count that would not fit.

Identical on every rank by construction: the dispatcher feeds it the MAX over the ranks of
each measured time and the bucket from the ranks' row counts, both carried by the counts
exchange it does anyway (no extra collective, no extra host sync); the tuner itself is a pure
function of that shared history.

It does not time anything itself, never talks to other ranks and computes no memory.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from moescale.parallel.memory_model import MAX_CHUNKS


@dataclass(kw_only=True)
class TunerConfig:
    candidates: tuple[int, ...] = (1, 2, 4, 8)
    trials: int = 3              # measurements per candidate before exploiting the best
    warmup: int = 2              # first calls of a bucket run 1 chunk and are not recorded

    def __post_init__(self) -> None:
        cands = tuple(self.candidates)
        if not cands or any(not isinstance(c, int) or c < 1 for c in cands):
            raise ValueError(f"candidates={self.candidates!r} must be positive chunk counts")
        if 1 not in cands:
            raise ValueError(f"candidates={self.candidates!r} must include 1 (no pipelining) "
                             "so the tuner can never do worse than the plain exchange")
        self.candidates = tuple(sorted(set(cands)))
        if not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"trials={self.trials!r} must be an integer >= 1")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be an integer >= 0 (calls not "
                             "measured at the start of each bucket)")


def bucket_of(max_rows: int) -> int:
    """Token-count bucket: rows in [2^(b-1), 2^b) share bucket b (0 for no rows)."""
    return int(max_rows).bit_length()


@dataclass
class ChunkTuner:
    config: TunerConfig = field(default_factory=TunerConfig)
    samples: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)   # warm-up measurements dropped

    def _bucket(self, bucket: int) -> dict[int, list[float]]:
        return self.samples.setdefault(bucket, {c: [] for c in self.config.candidates})

    def _allowed(self, allowed) -> tuple[int, ...]:
        if allowed is None:
            return self.config.candidates
        allowed = tuple(sorted(set(allowed)))
        if not allowed or any(not isinstance(c, int) or c < 1 for c in allowed):
            raise ValueError(f"allowed={allowed!r} must be a non-empty set of positive chunk "
                             "counts")
        return allowed

    def choose(self, bucket: int, allowed: tuple[int, ...] | None = None) -> int:
        """Next chunk count for this bucket: warm up at the fewest chunks (1 unless `allowed`
        excludes it), explore round-robin, then the fastest; only `allowed` counts (default:
        the candidates)."""
        allowed = self._allowed(allowed)
        if self.skipped.get(bucket, 0) < self.config.warmup:
            return allowed[0]
        table = self._bucket(bucket)
        fewest = min(len(table.get(c, ())) for c in allowed)
        if fewest < self.config.trials:
            return next(c for c in allowed if len(table.get(c, ())) == fewest)
        return self.best(bucket, allowed)

    def best(self, bucket: int, allowed: tuple[int, ...] | None = None) -> int:
        """The allowed count with the smallest median time (the fewest allowed before any
        measurement)."""
        allowed = self._allowed(allowed)
        table = self._bucket(bucket)
        measured = [c for c in allowed if table.get(c)]
        if not measured:
            return allowed[0]
        return min(measured, key=lambda c: (statistics.median(table[c]), c))

    def record(self, bucket: int, chunks: int, seconds: float) -> None:
        """One measured call of `chunks` in `bucket` (the warm-up calls are dropped). Each
        candidate keeps its first `trials` times, so the choice is fixed once the bucket is
        explored (no flip-flopping on noise) and memory stays bounded over a long run."""
        if self.skipped.get(bucket, 0) < self.config.warmup:
            self.skipped[bucket] = self.skipped.get(bucket, 0) + 1
            return
        table = self._bucket(bucket)
        if chunks not in table and isinstance(chunks, int) and 0 < chunks <= MAX_CHUNKS:
            table[chunks] = []       # a count beyond the candidates, chosen under a limit
        times = table.get(chunks)
        if times is not None and len(times) < self.config.trials:
            times.append(float(seconds))

    def converged(self, bucket: int, allowed: tuple[int, ...] | None = None) -> bool:
        table = self._bucket(bucket)
        return all(len(table.get(c, ())) >= self.config.trials for c in self._allowed(allowed))
