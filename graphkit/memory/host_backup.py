"""The host copy that memory made with ``backup=True`` keeps of its bytes while it sleeps.

Pinning host memory is slow (about 0.5 s per GB on an H100 host), and pageable
memory gets its pages at its first write, so the copy's buffers are made (and
written once where pageable) on a background thread before the pause, not in
it: a pause then only copies. Each span of device memory (an elastic range, a
region's segment) is held by pieces keyed by the device address their bytes
come from. With ``grow=True`` the pieces of a span that grows come as powers of
two (the framework's pinned allocator rounds every request up to one), each at
least a quarter of what is covered already, so a range that grows granule by
granule gets a few dozen pieces, none of them made twice; otherwise a span
gets one piece of its exact size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

import hal

log = logging.getLogger(__name__)

Spans = Sequence[tuple[int, int]]  # (device address, bytes)


def _piece_bytes(missing: int, covered: int) -> int:
    """The size of the next piece: a power of two of at least ``missing`` bytes and a quarter of ``covered``."""
    want = max(missing, covered // 4, 1)
    return 1 << (want - 1).bit_length()


class HostBackup:
    """Host pieces that hold spans of device memory while it sleeps (pinned where asked), made ahead of the
    pause and reused from sleep to sleep.

    :attr:`held` says whether they hold the current sleep's bytes.

    :param pin: pinned host memory (the copies then run at the bus's speed); pageable otherwise.
    :param grow: pieces in growing powers of two (a span that grows); else one piece per span.
    :param name: what the background thread and its warning call the owner.
    """

    def __init__(self, pin: bool, *, grow: bool = False, name: str = "graphkit-backup") -> None:
        self.pin = pin
        self.grow = grow
        self.name = name
        self.pieces: dict[int, torch.Tensor] = {}  # device address -> the host buffer of the bytes from there
        self._lock = threading.Lock()  # the bookkeeping (short holds only)
        self._making = threading.Lock()  # one maker of pieces at a time (held while pinning)
        self._wanted: list[tuple[int, int]] = []  # what the background thread covers before it ends
        self._running = False
        self.thread: threading.Thread | None = None  # the last background thread (kept once it ended)
        self.held = False
        self._woke_held = False  # what held was when the last sleep ended
        self.pin_seconds = 0.0  # time spent making pieces, in the background or on the pause path

    def wake(self) -> None:
        """The sleep ended: the next pause backs up afresh (:meth:`sleep_again` undoes this)."""
        self._woke_held, self.held = self.held, False

    def sleep_again(self) -> None:
        """Back to the sleep :meth:`wake` ended (a failed resume rolled back): it holds that sleep's bytes again."""
        self.held = self._woke_held

    def discard(self) -> None:
        """The bytes saved are not the memory's (the pause that saved them was undone): the next pause saves afresh."""
        self.held = False

    @property
    def host_bytes(self) -> int:
        """Host bytes made so far."""
        with self._lock:
            return sum(p.numel() for p in self.pieces.values())

    def _chain(self, ptr: int, size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset, piece)`` of the pieces that cover ``size`` bytes from ``ptr`` so far, in order."""
        offset = 0
        while offset < size:
            piece = self.pieces.get(ptr + offset)
            if piece is None:
                return
            yield offset, piece
            offset += piece.numel()

    def _covered(self, ptr: int, size: int) -> int:
        return sum(piece.numel() for _, piece in self._chain(ptr, size))

    def forget(self, ptr: int, size: int) -> None:
        """Drop the pieces of the span at ``ptr`` (its memory went)."""
        with self._lock:
            for offset, _ in list(self._chain(ptr, size)):
                del self.pieces[ptr + offset]

    def prepare(self, spans: Spans) -> None:
        """Make pieces until every span has a place on the host (nothing when they have)."""
        with self._making:
            for ptr, size in spans:
                covered = self._covered(ptr, size)
                while covered < size:
                    start = time.perf_counter()
                    n = _piece_bytes(size - covered, covered) if self.grow else size - covered
                    piece = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
                    if not self.pin:  # pageable memory gets its pages at the first write: now, not in the first pause
                        piece.zero_()
                    with self._lock:
                        self.pieces[ptr + covered] = piece
                        self.pin_seconds += time.perf_counter() - start
                    covered += n

    def prepare_in_background(self, spans: Spans) -> None:
        """:meth:`prepare` ``spans`` on a thread of its own (one at a time; a running one takes the new spans)."""
        with self._lock:
            self._wanted = list(spans)
            if self._running:
                return
            self._running = True
            self.thread = thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                wanted = self._wanted
                if all(self._covered(ptr, size) >= size for ptr, size in wanted):
                    self._running = False
                    return
            try:
                self.prepare(wanted)
            except Exception as exc:  # noqa: BLE001 - the pause makes what is missing, and raises there if it must
                log.warning("%s: backup buffers not made in the background (the pause makes them): %s", self.name,
                            exc)
                with self._lock:
                    self._running = False
                return

    def wait(self) -> None:
        """Wait for the background thread, if one runs."""
        thread = self.thread
        if thread is not None:
            thread.join()

    def save(self, backend: hal.Backend, spans: Spans) -> None:
        """Copy the spans to the host and wait for the copy (pieces still missing are made first)."""
        self.wait()
        self.prepare(spans)
        for ptr, size in spans:
            for offset, piece in self._chain(ptr, size):
                n = min(piece.numel(), size - offset)
                piece[:n].copy_(backend.tensor_at(ptr + offset, n), non_blocking=self.pin)
        backend.synchronize()
        self.held = True

    def restore(self, backend: hal.Backend, spans: Spans) -> None:
        """Copy the saved bytes of the spans back and wait for the copy (:attr:`held` stays as it is)."""
        for ptr, size in spans:
            for offset, piece in self._chain(ptr, size):
                n = min(piece.numel(), size - offset)
                backend.tensor_at(ptr + offset, n).copy_(piece[:n], non_blocking=True)
        backend.synchronize()


class HostBacked:
    """The host backup figures of memory whose :class:`HostBackup` is ``_backup``."""

    _backup: HostBackup

    @property
    def host_bytes(self) -> int:
        """Host bytes made for the backup: made ahead of the pauses (as memory grows, or as a region ends)."""
        return self._backup.host_bytes

    @property
    def pin_seconds(self) -> float:
        """Time spent making (pinning) the backup's host buffers, off the pause path or on it."""
        return self._backup.pin_seconds

    def wait_for_backup(self) -> None:
        """Wait until the backup's host buffers being made in the background are made (the next pause then
        only copies)."""
        self._backup.wait()
