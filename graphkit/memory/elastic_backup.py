"""The host copy an elastic buffer made with ``backup=True`` keeps of its bytes while it sleeps.

Pinning host memory is slow (about 0.5 s per GB on an H100 host), and pageable
memory gets its pages at its first write, so the copy's buffers are made (and
written once where pageable) on a background thread as the buffer grows, not
when it is paused: a pause then only copies. They come in pieces, each a power of two
(the framework's pinned allocator rounds every request up to one) and at least
a quarter of what is covered already, so a range that grows granule by
granule gets a few dozen pieces, none of them made twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch

import hal

log = logging.getLogger("graphkit.memory.elastic")


def _piece_bytes(missing: int, covered: int) -> int:
    """The size of the next piece: a power of two of at least ``missing`` bytes and a quarter of ``covered``."""
    want = max(missing, covered // 4, 1)
    return 1 << (want - 1).bit_length()


class HostBackup:
    """Host pieces that hold the start of a range while it sleeps (pinned where the device is not the host),
    made ahead of the pause and reused from sleep to sleep.

    :attr:`held` says whether they hold the current sleep's bytes.
    """

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []  # piece k holds the bytes right after those of pieces 0..k-1
        self._covered = 0
        self._lock = threading.Lock()  # the bookkeeping (short holds only)
        self._making = threading.Lock()  # one maker of pieces at a time (held while pinning)
        self._wanted = 0  # what the background thread covers before it ends
        self._thread: threading.Thread | None = None
        self.held = False
        self._woke_held = False  # what held was when the last sleep ended
        self.pin_seconds = 0.0  # time spent making pieces, in the background or on the pause path

    def wake(self) -> None:
        """The sleep ended: the next pause backs up afresh (:meth:`sleep_again` undoes this)."""
        self._woke_held, self.held = self.held, False

    def sleep_again(self) -> None:
        """Back to the sleep :meth:`wake` ended (a failed resume rolled back): it holds that sleep's bytes again."""
        self.held = self._woke_held

    @property
    def host_bytes(self) -> int:
        """Host bytes made so far."""
        return self._covered

    def prepare(self, size: int, pin: bool) -> None:
        """Make pieces until the first ``size`` bytes have a place on the host (nothing when they have)."""
        with self._making:
            while self._covered < size:
                start = time.perf_counter()
                piece = torch.empty(_piece_bytes(size - self._covered, self._covered), dtype=torch.uint8,
                                    pin_memory=pin)
                if not pin:  # pageable memory gets its pages at the first write: now, not in the first pause
                    piece.zero_()
                with self._lock:
                    self._pieces.append(piece)
                    self._covered += piece.numel()
                    self.pin_seconds += time.perf_counter() - start

    def prepare_in_background(self, size: int, pin: bool) -> None:
        """:meth:`prepare` ``size`` bytes on a thread of its own (one at a time; a running one takes the new size)."""
        with self._lock:
            self._wanted = max(self._wanted, size)
            if self._thread is not None or self._covered >= self._wanted:
                return
            self._thread = thread = threading.Thread(target=self._run, args=(pin,), name="graphkit-elastic-backup",
                                                     daemon=True)
        thread.start()

    def _run(self, pin: bool) -> None:
        while True:
            with self._lock:
                wanted = self._wanted
                if self._covered >= wanted:
                    self._thread = None
                    return
            try:
                self.prepare(wanted, pin)
            except Exception as exc:  # noqa: BLE001 - the pause makes what is missing, and raises there if it must
                log.warning("elastic buffer: backup buffers not made in the background (the pause makes them): %s",
                            exc)
                with self._lock:
                    self._thread = None
                return

    def wait(self) -> None:
        """Wait for the background thread, if one runs."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def _spans(self, size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset, host view)`` covering the first ``size`` bytes, piece by piece."""
        offset = 0
        for piece in self._pieces:
            if offset >= size:
                return
            n = min(piece.numel(), size - offset)
            yield offset, piece[:n]
            offset += n

    def save(self, backend: hal.Backend, ptr: int, size: int) -> None:
        """Copy ``size`` bytes at ``ptr`` to the host and wait for the copy (pieces still missing are made first)."""
        pin = backend.torch_device().type != "cpu"
        self.wait()
        self.prepare(size, pin)
        for offset, host in self._spans(size):
            host.copy_(backend.tensor_at(ptr + offset, host.numel()), non_blocking=pin)
        backend.synchronize()
        self.held = True

    def restore(self, backend: hal.Backend, ptr: int, size: int) -> None:
        """Copy the saved bytes back to ``ptr`` and wait for the copy (:attr:`held` stays as it is)."""
        assert self._covered >= size, "restore() before save()"
        for offset, host in self._spans(size):
            backend.tensor_at(ptr + offset, host.numel()).copy_(host, non_blocking=True)
        backend.synchronize()
