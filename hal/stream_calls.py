"""The stream calls of :class:`hal.Backend` (the device, its streams, waiting for them, the state libraries make on a
capture stream, whether a capture is under way), and the check of the objects the graph calls are handed
(:class:`hal.graph_calls.GraphCalls` builds on it)."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import Any

from hal.errors import InvalidArgumentError
from hal.hook_calls import HookCalls
from hal.plugin_class import current_device

_PLAIN_VALUES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
#: where each kind of object comes from, for the error's fix
_MADE_BY = {"graph": "create_graph()", "pool": "create_pool() (a graphkit pool handle, or the framework's pool id)",
            "stream": "create_stream() or current_stream()", "source": "create_graph(lazy=True)"}


class StreamCalls(HookCalls):
    """The device's streams through the plugin, and what every graph call checks of the objects it is given."""

    def _check_object(self, call: str, kind: str, value: Any, *, optional: bool = False) -> None:
        """Refuse a plain value where ``call`` needs a ``kind`` ("graph", "pool", "stream") of this backend."""
        if kind == "pool" and _framework_pool_id(value):
            return
        if (value is None and not optional) or isinstance(value, _PLAIN_VALUES):
            raise self._err(InvalidArgumentError, call, f"{kind}={value!r} is not a {kind} of this backend: pass "
                            f"one from {self.name}'s {_MADE_BY[kind]}{' or None' if optional else ''}")

    # -- streams ----------------------------------------------------------

    def torch_device(self) -> Any:
        """The ``torch.device`` of this backend's device."""
        return self._graph_call("torch_device")

    def create_stream(self) -> Any:
        """A new stream on the device.

        >>> stream = be.create_stream()
        >>> with be.use_stream(stream):
        ...     y = x @ w                    # queued on ``stream``
        >>> be.synchronize(stream)
        """
        return self._graph_call("create_stream")

    def current_stream(self) -> Any:
        """The stream work is submitted to now."""
        return self._graph_call("current_stream")

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Context manager: ``stream`` is the current stream inside it.

        >>> with be.use_stream(be.create_stream()):
        ...     warm_up(model)               # work queued on that stream, not the current one
        """
        self._check_object("use_stream", "stream", stream)
        return self._graph_call("use_stream", stream=stream)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream`` (the whole device when ``None``).

        >>> be.replay(graph)
        >>> be.synchronize()                 # the replay's results are on the device now
        """
        self._check_object("synchronize", "stream", stream, optional=True)
        self._graph_call("synchronize", stream=stream)

    def capturing(self) -> bool:
        """Whether the current stream of this thread captures a graph on this backend's device now (through
        :meth:`capture`, or the framework's own capture). Work queued now is recorded, not run, and a
        device-wide wait would end the capture. On the host, whether this thread records a capture of this
        backend with hal's host recorder (:mod:`hal.host`)."""
        if self._closed or not self.supports("graphs"):
            return False
        device = self._graph_call("torch_device")
        if device.type == "cpu":
            recorder = sys.modules.get("hal.host.tape")  # imported by the first capture: none before it
            return bool(recorder is not None and recorder.capturing(self.name))
        probe = getattr(getattr(sys.modules.get("torch"), device.type, None), "is_current_stream_capturing", None)
        return bool(probe()) if callable(probe) else False

    def default_capture_stream(self) -> Any:
        """The stream the framework's own capture API uses when it is given none."""
        if "default_capture_stream" not in self._implemented:
            return self.current_stream()
        return self._graph_call("default_capture_stream")

    def current_device(self) -> int:
        """The device the backend's framework calls current in this thread now (captures start there), as
        :func:`hal.get_backend` means it by default; this backend's own device where the plugin cannot tell."""
        self._check_open("current_device")
        ask = getattr(type(self.plugin), "current_device", None)
        if ask is None:
            return self.device
        return current_device(type(self.plugin))

    def prepare_capture_stream(self, stream: Any = None) -> None:
        """Make, outside any capture, the per-stream state the framework's libraries create lazily on ``stream``.

        cuBLAS and cuBLASLt allocate a workspace per stream (and library handle, one per thread) at their
        first GEMM there; inside a capture it would land in the capture's pool. hal does this itself before
        every capture it starts or routes; call it for a capture it never sees. ``stream`` defaults to the
        stream the framework's capture API uses when given none. Idempotent and cheap once done.

        :raises InvalidStateError: ``stream`` is capturing now.
        """
        self._check_open("prepare_capture_stream")
        self._check_object("prepare_capture_stream", "stream", stream, optional=True)
        if "prepare_capture_stream" not in self._implemented:
            return
        stream = stream if stream is not None else self.default_capture_stream()
        self._graph_call("prepare_capture_stream", stream=stream)

    def stream_state_sizes(self) -> dict[int, str]:
        """``{bytes: what}`` of the per-stream state :meth:`prepare_capture_stream` makes (``{}`` where none)."""
        self._check_open("stream_state_sizes")
        if "stream_state_sizes" not in self._implemented:
            return {}
        return dict(self._graph_call("stream_state_sizes"))

    def stream_state_bytes(self) -> int:
        """The bytes of per-stream state (the capture streams' BLAS workspaces) made so far on this device."""
        self._check_open("stream_state_bytes")
        if "stream_state_bytes" not in self._implemented:
            return 0
        return int(self._graph_call("stream_state_bytes"))


def _framework_pool_id(value: Any) -> bool:
    """Whether ``value`` may be a framework's pool id (``torch.cuda.graph_pool_handle()`` gives a tuple), which a
    capture takes as its pool too (the backend says whether it knows it)."""
    return isinstance(value, tuple) and len(value) > 0
