"""The stream calls of :class:`hal.Backend` (the device, its streams, waiting for them, whether a capture is under
way), and the check of the objects the graph calls are handed (:class:`hal.graph_calls.GraphCalls` builds on it)."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import Any

from hal.errors import InvalidArgumentError
from hal.hook_calls import HookCalls

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


def _framework_pool_id(value: Any) -> bool:
    """Whether ``value`` may be a framework's pool id (``torch.cuda.graph_pool_handle()`` gives a tuple), which a
    capture takes as its pool too (the backend says whether it knows it)."""
    return isinstance(value, tuple) and len(value) > 0
