"""The chunk tuner's decisions (pure, no processes): exploration order, best pick, errors."""

import pytest

from moescale.parallel.tuner import ChunkTuner, TunerConfig, bucket_of


def test_explores_every_candidate_round_robin_then_keeps_the_fastest():
    tuner = ChunkTuner(TunerConfig(candidates=(4, 1, 2), trials=2, warmup=0))
    times = {1: 3.0, 2: 1.0, 4: 2.0}   # one value per candidate: median = that value
    seen = []
    for _ in range(6):
        c = tuner.choose(bucket=5)
        seen.append(c)
        tuner.record(5, c, times[c])
    assert seen == [1, 2, 4, 1, 2, 4]
    assert tuner.converged(5) and tuner.choose(5) == 2 and tuner.best(5) == 2
    assert tuner.choose(6) == 1            # a new bucket starts over


def test_warmup_calls_run_one_chunk_and_are_not_recorded():
    tuner = ChunkTuner(TunerConfig(candidates=(1, 2), trials=1, warmup=2))
    seen = []
    for t in (50.0, 40.0, 3.0, 1.0):       # two slow warm-up calls would have made 1 lose
        c = tuner.choose(bucket=7)
        seen.append(c)
        tuner.record(7, c, t)
    assert seen == [1, 1, 1, 2]
    assert tuner.samples[7] == {1: [3.0], 2: [1.0]} and tuner.best(7) == 2
    assert tuner.choose(8) == 1 and tuner.skipped == {7: 2}   # each bucket warms up anew


def test_median_resists_one_slow_step():
    tuner = ChunkTuner(TunerConfig(candidates=(1, 2), trials=3, warmup=0))
    for t1, t2 in ((1.0, 1.2), (9.0, 1.2), (1.0, 1.2)):   # one stall while 1 ran
        tuner.record(0, 1, t1)
        tuner.record(0, 2, t2)
    assert tuner.best(0) == 1


def test_bucket_and_config_errors():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 1, 2, 2, 3, 10, 11]
    with pytest.raises(ValueError, match="must include 1"):
        TunerConfig(candidates=(2, 4))
    with pytest.raises(ValueError, match="trials=0"):
        TunerConfig(trials=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        TunerConfig(warmup=-1)
    with pytest.raises(ValueError, match="positive chunk counts"):
        TunerConfig(candidates=(1, 0))


def test_memory_stays_bounded_over_a_long_run():
    tuner = ChunkTuner(TunerConfig(candidates=(1, 2), trials=3, warmup=0))
    for step in range(10_000):
        c = tuner.choose(4)
        tuner.record(4, c, 1.0 if c == 1 else 2.0)
    assert {c: len(v) for c, v in tuner.samples[4].items()} == {1: 3, 2: 3}
    assert tuner.best(4) == 1
