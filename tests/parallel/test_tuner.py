"""The chunk tuner's decisions (pure, no processes): exploration order, best pick, errors."""

import pytest

from moescale.parallel.tuner import ChunkTuner, TunerConfig, bucket_of


def test_explores_every_candidate_then_keeps_the_fastest():
    tuner = ChunkTuner(TunerConfig(candidates=(4, 1, 2), trials=2))
    times = {1: 3.0, 2: 1.0, 4: 2.0}   # one value per candidate: median = that value
    seen = []
    for _ in range(6):
        c = tuner.choose(bucket=5)
        seen.append(c)
        tuner.record(5, c, times[c])
    assert seen == [1, 1, 2, 2, 4, 4]
    assert tuner.converged(5) and tuner.choose(5) == 2 and tuner.best(5) == 2
    assert tuner.choose(6) == 1            # a new bucket starts over


def test_bucket_and_config_errors():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 1, 2, 2, 3, 10, 11]
    with pytest.raises(ValueError, match="must include 1"):
        TunerConfig(candidates=(2, 4))
    with pytest.raises(ValueError, match="trials=0"):
        TunerConfig(trials=0)
    with pytest.raises(ValueError, match="positive chunk counts"):
        TunerConfig(candidates=(1, 0))
