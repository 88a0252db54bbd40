"""SimulatedDevice: exact byte accounting, a clear error past the budget, a recorded peak, and
copies that really run on a worker thread (overlap is structural, not timed)."""

import gc
import threading

import pytest
import torch

from moescale.devices import DeviceBudgetError, SimulatedDevice, make_device


def test_accounting_is_exact_and_peak_recorded():
    dev = SimulatedDevice(1000)
    a = dev.reserve(400, "a")
    b = dev.reserve(600, "b")
    assert dev.used_bytes == 1000 and dev.peak_bytes == 1000
    a.release()
    a.release()  # idempotent
    assert dev.used_bytes == 600
    c = dev.reserve(300, "c")
    assert dev.used_bytes == 900 and dev.peak_bytes == 1000
    del c  # dropped without release: the finalizer releases it
    gc.collect()
    assert dev.used_bytes == 600
    b.release()
    assert dev.used_bytes == 0 and dev.peak_bytes == 1000
    dev.reset_peak()
    assert dev.peak_bytes == 0


def test_over_budget_names_budget_use_and_request():
    dev = SimulatedDevice(1000)
    keep = dev.reserve(700, "first")
    with pytest.raises(DeviceBudgetError) as err:
        dev.reserve(400, "expert (0, 3)")
    msg = str(err.value)
    assert "400 bytes" in msg and "1000 bytes" in msg and "700 bytes" in msg
    assert "expert (0, 3)" in msg
    assert dev.used_bytes == 700 and dev.peak_bytes == 700
    keep.release()


def test_blocking_reserve_waits_only_for_async_releases():
    dev = SimulatedDevice(1000)
    sync = dev.reserve(500, "held by this thread")
    grad = dev.reserve(400, "gradient", async_release=True)
    with pytest.raises(DeviceBudgetError):  # 500 held synchronously + 600 can never fit
        dev.reserve(600, "too big", block=True)
    timer = threading.Timer(0.05, grad.release)
    timer.start()
    got = dev.reserve(500, "waits for the gradient", block=True)
    assert dev.used_bytes == 1000 and dev.peak_bytes <= 1000
    got.release(), sync.release()
    timer.join()


def test_uploads_run_on_a_worker_thread_and_overlap():
    dev = SimulatedDevice(None)
    gate = threading.Event()

    def prepare():
        gate.wait(5)  # the copy thread blocks here while the caller keeps going
        return [torch.arange(6.0)], lambda: None

    transfer = dev.upload_from(prepare, torch.bfloat16)
    assert not transfer.done()  # the caller was not blocked by the copy
    gate.set()
    (out,) = transfer.wait()
    assert out.dtype == torch.bfloat16 and out.tolist() == list(range(6))
    assert dev.copy_thread_names and threading.current_thread().name not in dev.copy_thread_names
    dev.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget_bytes"):
        SimulatedDevice(0)
    with pytest.raises(ValueError, match="device="):
        make_device("tpu", 10)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            make_device("cuda", 10)


@pytest.mark.skipif(getattr(torch._C, "_storage_Use_Count", None) is None,
                    reason="this torch exposes no storage use count: copies are always fresh")
def test_upload_copies_reuse_storage_nothing_holds():
    """An upload copies into a storage the device kept once its last copy was dropped (no fresh
    pages per copy), never into one a caller still holds."""
    dev = SimulatedDevice(1 << 20)
    try:
        src = torch.arange(1000, dtype=torch.float32)
        held = dev.upload([src]).wait()[0]
        again = dev.upload([src * 2]).wait()[0]
        assert held.data_ptr() != again.data_ptr()          # held: not written over
        assert torch.equal(held, src) and torch.equal(again, src * 2)
        ptr = again.data_ptr()
        del again
        third = dev.upload([src * 3], torch.float32).wait()[0]
        assert third.data_ptr() == ptr and torch.equal(third, src * 3)
        assert torch.equal(held, src)
        half = dev.upload([src], torch.bfloat16).wait()[0]   # another size: its own storage
        assert half.dtype == torch.bfloat16 and torch.equal(half, src.to(torch.bfloat16))
    finally:
        dev.close()
