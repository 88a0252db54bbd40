"""Fixtures of the fault-injection tests: a small real corpus and the training tests' helpers.

tests/train/train_helpers.py (the tiny model's overrides, the corpus builder) is shared by
putting its folder on the import path, so the fault tests train exactly the model the training
tests do without a copy of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from train_helpers import small_corpus  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A directory corpus shared by every fault test (train_helpers.small_corpus)."""
    return small_corpus(tmp_path_factory.mktemp("corpus") / "c")


@pytest.fixture(scope="session")
def launcher():
    """One fork server for every `moescale train` process of the fault tests."""
    from fault_helpers import Launcher

    return Launcher()


@pytest.fixture(scope="session")
def reference(launcher, corpus, tmp_path_factory):
    """(step, loss, grad_norm) of an uninterrupted run of the kill tests' configuration."""
    from fault_helpers import losses
    from kill_loop import STEPS, loop_args

    base = tmp_path_factory.mktemp("reference")
    code, text = launcher.run(loop_args(corpus, base / "run", STEPS), base)
    assert code == 0, text
    return losses(base / "run")
