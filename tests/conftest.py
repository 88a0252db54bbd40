"""Shared test helpers: run a layer and its reference oracle on the same input, compare.

The fixtures here hand out plain functions and small dataclasses so that every test file
compares fast paths against `moescale.layers.reference.ReferenceMoE` the same way:
outputs, every gradient (input, router weights, every expert weight) and the aux loss,
with a tolerance relative to the scale of the reference value. They deliberately hold no
state between tests (no module-level mutable objects) and never mock the code under test.

The `slow` marker (multi-process end-to-end runs, soak loops, benchmarks, the larger rank
counts) is what the fast lane, `pytest -m "not slow"`, leaves out; the default run (the README's
test command, CI) runs everything. Whole files can be marked here (SLOW_FILES).

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from moescale.layers.reference import ReferenceMoE
from moescale.shared_store.node_store import DIRECTORY_VARIABLE

# Tolerances relative to the reference's scale (max |value|).
FP32_RTOL = 1e-5
BF16_RTOL = 4e-2


@dataclass
class Run:
    """One forward + backward: the output, named gradients and the aux loss."""

    y: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    aux_loss: torch.Tensor


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                        what: str = "value") -> None:
    """max |actual - expected| <= rtol * max(max |expected|, 1e-6), compared in fp32."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    actual, expected = actual.detach().float(), expected.detach().float()
    if expected.numel() == 0:
        return
    scale = max(expected.abs().max().item(), 1e-6)
    err = (actual - expected).abs().max().item()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3g} > {rtol:g} * scale {scale:.3g}"


def forward_backward(layer: nn.Module, params: dict[str, nn.Parameter], x: torch.Tensor,
                     grad_out: torch.Tensor, seed: int, *, autocast_dtype=None) -> Run:
    """Seed torch, run `layer(x)`, backpropagate <y, grad_out> + aux loss to x and params.

    `layer` is an MoE or its ReferenceMoE (both expose `last_aux_loss` after a call).
    """
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        y = layer(x)
    aux = layer.last_aux_loss
    loss = (y.float() * grad_out.float()).sum() + aux.float()
    names = list(params)
    grads = torch.autograd.grad(loss, [x] + [params[n] for n in names], allow_unused=True)
    return Run(y=y.detach(), grads=dict(zip(["input"] + names, grads)), aux_loss=aux.detach())


def compare_runs(fast: Run, ref: Run, rtol: float) -> None:
    """Outputs, aux loss and every gradient agree; a gradient is None in both or in neither."""
    assert_scaled_close(fast.y, ref.y, rtol, "output")
    assert_scaled_close(fast.aux_loss, ref.aux_loss, rtol, "aux loss")
    assert fast.grads.keys() == ref.grads.keys()
    for name, g_ref in ref.grads.items():
        g_fast = fast.grads[name]
        if g_ref is None or g_fast is None:
            # A parameter the loss does not reach (e.g. noisy_topk's noise weight in eval).
            assert g_ref is None and g_fast is None or \
                (g_ref if g_ref is not None else g_fast).abs().max() == 0, \
                f"grad of {name}: fast {g_fast is not None}, reference {g_ref is not None}"
            continue
        assert_scaled_close(g_fast, g_ref, rtol, f"grad of {name}")


def check_against_reference(moe: nn.Module, x: torch.Tensor, *, seed: int = 1234,
                            rtol: float = FP32_RTOL, autocast_dtype=None,
                            ref_moe: nn.Module | None = None) -> tuple[Run, Run, ReferenceMoE]:
    """Run `moe` and `ReferenceMoE(ref_moe or moe)` on x with the same seed and compare all.

    `ref_moe` is an fp32 twin of a low-precision `moe` (same parameter names); the reference
    always runs in fp32 without autocast. Returns (fast run, reference run, the reference).
    """
    ref_moe = moe if ref_moe is None else ref_moe
    ref = ReferenceMoE(ref_moe)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(x.shape, generator=gen)
    fast = forward_backward(moe, dict(moe.named_parameters()), x, grad_out, seed,
                            autocast_dtype=autocast_dtype)
    reference = forward_backward(ref, dict(ref_moe.named_parameters()), x.float(), grad_out,
                                 seed)
    compare_runs(fast, reference, rtol)
    return fast, reference, ref


def fp32_twin(moe: nn.Module, build) -> nn.Module:
    """`build()` makes a layer of the same architecture; load moe's values into it in fp32."""
    twin = build()
    twin.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    twin.train(moe.training)
    return twin


def force_routing(moe: nn.Module, x_TD: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """Make every token pick `experts` (in that order) by setting the router weights.

    Returns an input whose feature 0 is a constant 1.0; the router weight row of the i-th
    forced expert reads only that feature with a decreasing large value, all other rows are 0.
    """
    x_TD = x_TD.clone()
    x_TD[..., 0] = 1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        for rank, e in enumerate(experts):
            moe.router.weight[e, 0] = 8.0 - rank
    return x_TD


class Helpers:
    """Namespace handed to tests by the `moe_helpers` fixture."""

    FP32_RTOL = FP32_RTOL
    BF16_RTOL = BF16_RTOL
    Run = Run
    assert_scaled_close = staticmethod(assert_scaled_close)
    forward_backward = staticmethod(forward_backward)
    compare_runs = staticmethod(compare_runs)
    check_against_reference = staticmethod(check_against_reference)
    fp32_twin = staticmethod(fp32_twin)
    force_routing = staticmethod(force_routing)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Run every test module with one intra-op thread, restoring the setting afterwards.

    Tiny tensors gain nothing from a thread pool, and on a loaded 2-core machine OpenMP's
    spinning workers make each op 10-100x slower. Applies to the whole suite (autouse);
    subprocesses set their own thread count.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def moe_helpers() -> type[Helpers]:
    """The comparison helpers above (fixtures keep test files free of cross-file imports)."""
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


def pytest_collection_finish(session):
    """Start the fork server with FORKSERVER_PRELOAD when a selected test may fork from it.

    The server (and so every process forked from it that does not redirect its own output, e.g.
    run_local's ranks; their errors come back through run_local) writes to /dev/null, not into
    the output pytest is capturing at that moment: the doc scripts' ranks come from this server
    too (tests/warm_runner.py) and would print into the progress line."""
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
    if not os.path.isdir("/dev/shm"):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    directory = tempfile.mkdtemp(prefix=f"moescale-tests-{worker}-", dir="/dev/shm")
    config.stash[SHM_DIR] = directory
    os.environ[DIRECTORY_VARIABLE] = directory


def pytest_unconfigure(config):
    directory = config.stash.get(SHM_DIR, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(DIRECTORY_VARIABLE, None)
