"""Parts of the cuda backend that run without a GPU: the probe and the allocator callbacks."""

from __future__ import annotations

import ctypes
import gc
import logging
import subprocess
import sys

import pytest

from hal.backends.cuda import torch_pool
from hal.backends.cuda.torch_pool import CallbackPair


def test_import_stays_cheap() -> None:
    code = ("import sys, hal, hal.backends.cuda; hal.list_backends(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_gives_a_reason_or_none() -> None:
    from hal.backends.cuda.probe import probe_reason

    reason = probe_reason()
    assert reason is None or (isinstance(reason, str) and reason)


def _call_alloc(pair: CallbackPair, size: int, device: int = 0) -> int:
    """Call the C alloc callback through its function pointer, as torch would."""
    fn = ctypes.cast(pair.addresses[0], torch_pool.ALLOC_FN)
    return fn(size, device, None) or 0


def _call_free(pair: CallbackPair, ptr: int, size: int, device: int = 0) -> None:
    ctypes.cast(pair.addresses[1], torch_pool.FREE_FN)(ptr, size, device, None)


def test_callbacks_pass_through_and_track_segments() -> None:
    seen: list[tuple] = []
    pair = CallbackPair(lambda n: seen.append(("alloc", n)) or 0x10000, lambda p, n: seen.append(("free", p, n)),
                        device=0, label="test pool")
    assert _call_alloc(pair, 4096) == 0x10000
    assert pair.live == {0x10000: 4096}
    _call_free(pair, 0x10000, 4096)
    assert seen == [("alloc", 4096), ("free", 0x10000, 4096)]
    assert pair.live == {}


def test_alloc_never_raises_and_logs_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    def alloc(n: int) -> int:
        raise MemoryError("capacity of 2.0 MiB reached")

    pair = CallbackPair(alloc, lambda p, n: None, device=0, label="test pool")
    with caplog.at_level(logging.ERROR, logger="hal.cuda"):
        assert _call_alloc(pair, 1 << 20) == 0
    assert "capacity of 2.0 MiB reached" in caplog.text
    assert "capacity of 2.0 MiB reached" in (pair.last_error or "")
    pair2 = CallbackPair(lambda n: 0, lambda p, n: None, device=0, label="test pool")
    assert _call_alloc(pair2, 512) == 0 and "returned no memory" in (pair2.last_error or "")


def test_alloc_refuses_another_device() -> None:
    pair = CallbackPair(lambda n: 0x20000, lambda p, n: None, device=1, label="test pool")
    assert _call_alloc(pair, 512, device=0) == 0
    assert "device 0" in (pair.last_error or "")


def test_gc_is_off_inside_the_callbacks() -> None:
    states: list[bool] = []
    pair = CallbackPair(lambda n: states.append(gc.isenabled()) or 0x30000,
                        lambda p, n: states.append(gc.isenabled()), device=0, label="test pool")
    assert gc.isenabled()
    _call_alloc(pair, 512)
    _call_free(pair, 0x30000, 512)
    assert states == [False, False] and gc.isenabled()


def test_released_pair_forgets_callables_after_last_free() -> None:
    pair = CallbackPair(lambda n: 0x40000, lambda p, n: None, device=0, label="test pool")
    _call_alloc(pair, 512)
    pair.pool_released = True
    assert pair.alloc is not None
    _call_free(pair, 0x40000, 512)
    assert pair.alloc is None and pair.free is None
    assert _call_alloc(pair, 512) == 0 and "released" in (pair.last_error or "")
