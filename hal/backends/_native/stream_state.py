"""State that torch's libraries create at their first use of a stream, made ahead of captures.

cuBLAS and cuBLASLt keep one workspace per (library handle, stream) and torch
allocates it through its caching allocator the first time a GEMM runs on that
stream with that handle (one handle per thread and device). Measured on an H100
with torch 2.11: the first GEMM of any floating dtype on a fresh stream leaves
32 MiB allocated (cuBLAS's workspace; ``CUBLAS_WORKSPACE_CONFIG``); the first GEMM
with a bias epilogue (``addmm``, ``linear`` with a bias, ``_scaled_mm``) leaves
another 1 MiB (cuBLASLt's; none when ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes
it share cuBLAS's); a second thread on the same stream gets a workspace of its own;
attention (SDPA) and elementwise kernels leave nothing. Inside a capture that
allocation comes from the capture's pool, where other graphs overwrite it.

:class:`StreamState` runs one small plain GEMM and one with a bias, in float32,
bfloat16 and float16, on the current stream before a capture begins there: the
workspaces exist before the capture, in the device's own memory. It remembers
what it prepared by (device, stream, library handle), so a stream is prepared
once per thread; it never runs while the current stream captures.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("hal.stream_state")

#: what the first plain GEMM and the first GEMM with a bias epilogue on a stream create, by device type
_WHAT = {"cuda": ("cuBLAS's workspace", "cuBLASLt's workspace")}


class StreamState:
    """The per-stream state of one torch device namespace (``torch.cuda``, ``torch.npu``...), made ahead.

    :param torch: the torch module.
    :param ns: the device namespace.
    :param device_type: its device type (``"cuda"``).
    """

    def __init__(self, torch: Any, ns: Any, device_type: str) -> None:
        self.torch, self.ns, self.device_type = torch, ns, device_type
        self._prepared: set[tuple[int, Any, Any]] = set()
        self._sizes: dict[int, dict[int, str]] = {}  # device -> {bytes: what}, measured at its first preparation
        self._made: dict[int, int] = {}  # device -> bytes made by every preparation so far
        self._lock = threading.Lock()

    def sizes(self, device: int) -> dict[int, str]:
        """``{bytes: what}`` that preparing a stream of ``device`` allocated (empty before the first one)."""
        return dict(self._sizes.get(device, {}))

    def made(self, device: int) -> int:
        """The bytes every preparation on ``device`` made so far (all streams and threads)."""
        return self._made.get(device, 0)

    def prepare(self, stream: Any) -> None:
        """Prepare ``stream`` (made current for the call) on this thread."""
        with self.ns.stream(stream):
            self.prepare_current()

    def prepare_current(self) -> None:
        """Make the state on the current stream and device, once per (device, stream, library handle)."""
        ns = self.ns
        capturing = getattr(ns, "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            return  # inside a capture it would land in the capture's pool
        current_device = getattr(ns, "current_device", None)
        device = current_device() if current_device is not None else 0
        allocated = getattr(ns, "memory_allocated", None)
        # measured from before the library handle is asked for: asking may make the workspace already
        start = allocated(device) if allocated is not None else 0
        key = (device, _stream_key(ns.current_stream()), self._handle())
        if key in self._prepared:
            return
        by_handle = allocated(device) - start if allocated is not None else 0
        inputs = self._inputs(device)  # made before the GEMMs are measured
        before = allocated(device) if allocated is not None else 0
        made = self._run_gemms(inputs, device, allocated, before)
        total = by_handle + (allocated(device) - before if allocated is not None else 0)
        if by_handle > 0:
            made[by_handle] = made.get(by_handle, _WHAT.get(self.device_type, ("BLAS state",))[0])
        with self._lock:
            self._prepared.add(key)
            self._made[device] = self._made.get(device, 0) + max(0, total)
            if made and device not in self._sizes:  # a stream that had its state already tells nothing
                self._sizes[device] = made
        log.debug("%s:%d: stream state prepared on stream %s (%s)", self.device_type, device, key[1],
                  ", ".join(f"{size} bytes: {what}" for size, what in made.items()) or "not measured")

    def _handle(self) -> Any:
        """The library handle the current thread uses (a workspace is kept per handle and stream)."""
        blas_handle = getattr(self.ns, "current_blas_handle", None)
        return blas_handle() if blas_handle is not None else threading.get_ident()

    def _inputs(self, device: int) -> list[tuple[Any, Any]]:
        """A small matrix and a bias in each floating dtype the device has."""
        torch = self.torch
        inputs = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            try:
                a = torch.ones(8, 8, dtype=dtype, device=torch.device(self.device_type, device))
                inputs.append((a, torch.ones(8, dtype=dtype, device=a.device)))
            except Exception as exc:  # noqa: BLE001 - a build or dtype without such tensors: nothing to make
                log.debug("%s: no %s tensors here: %s", self.device_type, dtype, exc)
        return inputs

    def _run_gemms(self, inputs: list[tuple[Any, Any]], device: int, allocated: Any, start: int) -> dict[int, str]:
        """One plain GEMM and one with a bias per input; ``{bytes: what}`` they left allocated.

        :param allocated: ``memory_allocated(device)`` where the sizes are measured, else None.
        :param start: what it returned before the library handle was asked for.
        """
        torch = self.torch
        plain, biased = _WHAT.get(self.device_type, (f"{self.device_type} BLAS state",) * 2)
        made: dict[int, str] = {}
        before = start
        for a, bias in inputs:
            for what, args in ((plain, (None, a, a)), (biased, (bias, a, a))):
                try:
                    torch.mm(a, a) if args[0] is None else torch.addmm(*args)
                except RuntimeError as exc:  # a dtype the device's BLAS lacks: nothing of it to make
                    log.debug("%s: %s GEMM not run: %s", self.device_type, a.dtype, exc)
                    continue
                if allocated is not None:
                    after = allocated(device)
                    if after > before:
                        made.setdefault(after - before, what)
                    before = after
        return made


def _stream_key(stream: Any) -> Any:
    """What identifies a framework stream (its id within its device), whatever the device type."""
    ident = getattr(stream, "stream_id", None)
    return ident if ident is not None else id(stream)


_by_namespace: dict[int, StreamState] = {}
_by_namespace_lock = threading.Lock()


def stream_state(torch: Any, ns: Any, device_type: str) -> StreamState:
    """The process's one :class:`StreamState` of the device namespace ``ns``."""
    with _by_namespace_lock:
        state = _by_namespace.get(id(ns))
        if state is None or state.ns is not ns:
            state = _by_namespace[id(ns)] = StreamState(torch, ns, device_type)
        return state
