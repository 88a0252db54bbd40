"""Fixtures shared by the training tests: a module's small real text corpus."""

from __future__ import annotations

import pytest

from train_helpers import small_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory corpus (train_helpers.small_corpus), one per test module."""
    return small_corpus(tmp_path_factory.mktemp("corpus") / "c")
