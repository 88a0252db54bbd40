"""The suite's fixtures and hooks. `moe_helpers` hands out the MoE comparison helpers
(tests/moe_checks.py: run a layer and its reference oracle on the same input, compare outputs,
every gradient and the aux loss). Nothing here imports torch at module level: pytest-xdist's
controller, which runs no test, loads this file before it starts the workers (~1.5 s).

The `slow` marker (multi-process end-to-end runs, soak loops, benchmarks, the larger rank
counts) is what the fast lane, `pytest -m "not slow"`, leaves out; the default run (the README's
test command, CI) runs everything. Whole files can be marked here (SLOW_FILES).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Run every test module with one intra-op thread, restoring the setting afterwards.

    Tiny tensors gain nothing from a thread pool, and on a loaded 2-core machine OpenMP's
    spinning workers make each op 10-100x slower. Applies to the whole suite (autouse);
    subprocesses set their own thread count.
    """
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def moe_helpers():
    """The comparison helpers of tests/moe_checks.py (its `Helpers` namespace)."""
    from moe_checks import Helpers
    return Helpers


# What every process forked for a test imports: the training CLI's modules (torch._dynamo comes
# with the meta-device parameter count of train/limits.py, about 1.4 s; matplotlib with the
# report). Python has one fork server per process, started with the preload list of whoever
# starts it first, and run_local (torch only) would otherwise start it before the fault tests'
# Launcher: then each of their ~40 trainer processes imported these itself (the kill loop took
# 31 s in the whole suite, 5 s alone). The doc blocks' `moescale` commands and scripts are forked
# from it too (tests/warm_runner.py).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "moescale.train.trainer", "torch._dynamo",
                      "matplotlib.pyplot", "moescale.cli"]
SPAWNING_DIRS = ("parallel/", "faults/", "train/", "bench/", "expert_state/", "offload/",
                 "docs/")


def check_groups_hold(session) -> None:
    """Under `--dist loadgroup` (in a worker) every test marked xdist_group must carry its group in
    its node id, which is how pytest-xdist keeps a group on one worker; with pytest 9.2 and
    pytest-xdist 3.8 it silently did not, and every worker built each shared baseline again."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        message = (f"--dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): this "
                   "pytest-xdist does not work with this pytest; install the versions "
                   "pyproject.toml's dev extra names (bash scripts/setup.sh)")
        capture = session.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():      # a worker's exit reason is not shown
            sys.stderr.write(f"\n{message}\n")
        raise pytest.UsageError(message)


def pytest_collection_finish(session):
    """Start the fork server with FORKSERVER_PRELOAD when a selected test may fork from it.

    The server (and so every process forked from it that does not redirect its own output, e.g.
    run_local's ranks; their errors come back through run_local) writes to /dev/null, not into
    the output pytest is capturing at that moment: the doc scripts' ranks come from this server
    too (tests/warm_runner.py) and would print into the progress line. First: the groups hold."""
    check_groups_hold(session)
    if any(item.nodeid.removeprefix("tests/").startswith(SPAWNING_DIRS)
           for item in session.items):
        import multiprocessing
        import multiprocessing.forkserver

        multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
        saved = os.dup(1), os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            multiprocessing.forkserver.ensure_running()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, devnull):
                os.close(fd)


# Trainer end-to-end files of launch paths the set-up matrix does not cover (torchrun through
# the CLI, several nodes, eager steps, gradient accumulation; seconds per test, a torchrun or
# multi-process run each): slow as whole files. Marked here, not in the files; the matrix
# (train/test_setup_matrix.py) marks itself; drop a line when its file goes.
SLOW_FILES = ("train/test_train_ep_offload.py", "train/test_train_nodes.py",
              "train/test_train_dynamic.py")


# Run first: the doc blocks, the longest tests.
FIRST = "tests/docs/"
# Fixtures that are module-scoped but cost nothing to set up twice.
CHEAP_SHARED_FIXTURES = ("one_intra_op_thread",)


def shares_a_fixture(item) -> bool:
    """Whether the test uses a module- or package-scoped fixture (a baseline run, a corpus)."""
    return any(defs[-1].scope in ("module", "package") and name not in CHEAP_SHARED_FIXTURES
               for name, defs in item._fixtureinfo.name2fixturedefs.items())


@pytest.hookimpl(tryfirst=True)      # before -m deselects
def pytest_collection_modifyitems(config, items):
    """Mark the tests of SLOW_FILES slow (the fast lane, `pytest -m "not slow"`, skips them).
    Under pytest-xdist (`--dist loadgroup`, scripts/test.sh) the tests of a file that share a
    module-scoped fixture stay on one worker (xdist_group), so its set-up (a baseline training
    run) happens once; every other test goes to whichever worker is free. The doc blocks (the
    longest tests, up to a minute each) go first, so that no worker starts one while the
    others run out of work."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.removeprefix("tests/") in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(path))
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))   # stable: files stay whole


SHM_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """Give this test process (each xdist worker, or the one pytest process) its own tmpfs
    directory for the node stores of dynamic placement ($MOESCALE_SHM_DIR, inherited by every
    process a test starts): the tests that check a run left no store file behind list that
    directory, which no concurrently running test (another worker, another checkout) writes."""
    if not os.path.isdir("/dev/shm") or xdist_controller(config):
        return
    from moescale.shared_store.node_store import DIRECTORY_VARIABLE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    directory = tempfile.mkdtemp(prefix=f"moescale-tests-{worker}-", dir="/dev/shm")
    config.stash[SHM_DIR] = directory
    os.environ[DIRECTORY_VARIABLE] = directory


def pytest_unconfigure(config):
    directory = config.stash.get(SHM_DIR, None)
    if directory is not None:
        from moescale.shared_store.node_store import DIRECTORY_VARIABLE
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(DIRECTORY_VARIABLE, None)


def xdist_controller(config) -> bool:
    """Whether this process is pytest-xdist's controller (it starts workers, runs no test)."""
    return "PYTEST_XDIST_WORKER" not in os.environ and bool(
        getattr(config.option, "numprocesses", None))
