"""torch's thread count in a run: train.threads holds from the model build to the end of run(),
and the caller's count comes back after each (train/threads.py)."""

from __future__ import annotations

import os

import pytest
import torch

from moescale.train.threads import auto_threads, torch_threads
from moescale.train.trainer import Trainer
from train_helpers import tiny_run_config


def test_torch_threads_sets_and_restores_even_on_error():
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(before + 2):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_auto_threads_stays_within_the_usable_cpus():
    threads, note = auto_threads()
    usable = len(os.sched_getaffinity(0))
    assert 1 <= threads <= usable and note.startswith("auto:")
    assert auto_threads(ranks=usable + 1)[0] == 1      # never below one thread a rank


def test_the_run_uses_train_threads_and_the_count_comes_back_after_build_and_run(corpus,
                                                                                tmp_path):
    seen = []
    config = tiny_run_config(corpus, tmp_path / "run", steps=2, every=2, keep_last=1,
                             **{"train.threads": "1"})
    with torch_threads(2):
        trainer = Trainer(config, tmp_path / "run", out=open(os.devnull, "w"))
        assert torch.get_num_threads() == 2
        # the first forward of the run sees the run's count
        trainer.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        assert trainer.run() == 0
        assert torch.get_num_threads() == 2
    assert seen and set(seen) == {1}
