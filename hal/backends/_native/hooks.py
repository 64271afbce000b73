"""The graph, stream and pool hooks of a backend, delegated to its :class:`TorchGlue`.

A backend may run without its torch extension (VMM hooks only): then
``"graphs"`` is absent from its capabilities and these hooks raise
:class:`hal.UnsupportedError` naming the missing extension.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, cast

from hal.api import AllocFn, FreeFn, hookimpl
from hal.backends._native.torch_glue import ExtensionGlue, TorchGlue
from hal.errors import BackendUnavailableError, UnsupportedError
from hal.types import MemInfo


def extension_report(glue: TorchGlue | None, extension: str) -> tuple[str | None, dict[str, str]]:
    """``(extension and version, {capability: why it is on or off})`` for ``python -m hal``.

    :param glue: the backend's glue, None when it runs without its extension.
    :param extension: the extension's module name.
    """
    if glue is None:
        return None, {"graphs": f"the backend runs without {extension} (VMM hooks only)"}
    reasons = getattr(glue, "capability_reasons", None)
    version = getattr(glue, "extension_version", extension)
    return version, (reasons() if reasons is not None else {})


class TorchHooks:
    """Mixin for a backend plugin with a ``glue`` attribute (a :class:`TorchGlue`, or None)."""

    #: the backend's name, as errors carry it
    backend_name: ClassVar[str]
    #: the torch extension's module name, for the error when it is absent
    torch_extension: ClassVar[str]
    #: the device type of its torch namespace (``torch.<type>``): ``cuda``, ``npu``, ``mlu``
    torch_device_type: ClassVar[str]
    glue: TorchGlue | None

    @classmethod
    def current_device(cls) -> int:
        """The device the framework calls current in this thread (``torch.<type>.current_device()``) once it is
        initialised in this process, else 0; nothing is imported or initialised to find out."""
        torch = sys.modules.get("torch")
        ns = getattr(torch, cls.torch_device_type, None) if torch is not None else None
        initialised = getattr(ns, "is_initialized", None)
        if ns is None or initialised is None or not initialised():
            return 0
        return int(ns.current_device())

    def _open_glue(self, use_torch: bool | None, installed: Callable[[], bool],
                   create: Callable[[], TorchGlue]) -> TorchGlue | None:
        """The glue this backend runs with, or None for VMM hooks only.

        :param use_torch: ``None``: use the extension when it is installed; ``False``: never
            import it; ``True``: require it.
        :param installed: whether the extension is installed (without importing it).
        :param create: makes the glue (this imports torch and the extension).
        :raises BackendUnavailableError: it is required but not installed, or it does not import.
        """
        extension, backend = self.torch_extension, self.backend_name
        if use_torch is None:
            use_torch = installed()
        elif use_torch and not installed():
            raise BackendUnavailableError(f"use_torch=True but {extension} is not installed", backend=backend)
        if not use_torch:
            return None
        try:
            return create()
        except ImportError as exc:
            raise BackendUnavailableError(f"{extension} is installed but does not import: {exc}",
                                          backend=backend) from exc

    def _current_glue(self) -> TorchGlue | None:
        """The glue the torch hooks use (a backend may open it lazily here), or None."""
        return self.glue

    def _torch(self, call: str) -> TorchGlue:
        glue = self._current_glue()
        if glue is None:
            raise UnsupportedError(f"needs {self.torch_extension}, which this backend runs without",
                                   backend=self.backend_name, call=call)
        return glue

    @hookimpl
    def capabilities(self) -> frozenset[str]:
        glue = self._current_glue()
        return glue.capabilities if glue is not None else frozenset()

    @hookimpl
    def torch_device(self) -> Any:
        return self._torch("torch_device").torch_device()

    @hookimpl
    def create_stream(self) -> Any:
        return self._torch("create_stream").create_stream()

    @hookimpl
    def current_stream(self) -> Any:
        return self._torch("current_stream").current_stream()

    @hookimpl
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self._torch("use_stream").use_stream(stream)

    @hookimpl
    def synchronize(self, stream: Any) -> None:
        self._torch("synchronize").synchronize(stream)

    @hookimpl
    def create_pool(self, alloc: AllocFn | None, free: FreeFn | None) -> Any:
        return self._torch("create_pool").create_pool(alloc, free)

    @hookimpl
    def pool_active_blocks(self, pool: Any) -> list[tuple[int, int]]:
        return self._torch("pool_active_blocks").pool_active_blocks(pool)

    @hookimpl
    def release_pool(self, pool: Any) -> None:
        self._torch("release_pool").release_pool(pool)

    @hookimpl
    def create_graph(self, lazy: bool) -> Any:
        # ``lazy`` has no default: pluggy passes only the arguments an implementation names without one
        return self._torch("create_graph").create_graph(lazy=lazy)

    @hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any,
                capture_error_mode: str | None) -> AbstractContextManager[Any]:
        return self._torch("capture").capture(graph, pool, stream, capture_error_mode)

    @hookimpl
    def route_captures(self, router: Any) -> AbstractContextManager[None]:
        return self._torch("route_captures").route_captures(router)

    @hookimpl
    def default_capture_stream(self) -> Any:
        return self._torch("default_capture_stream").default_capture_stream()

    @hookimpl
    def prepare_capture_stream(self, stream: Any) -> None:
        self._torch("prepare_capture_stream").prepare_capture_stream(stream)

    @hookimpl
    def stream_state_sizes(self) -> dict[int, str]:
        glue = self._current_glue()
        return glue.stream_state_sizes() if glue is not None else {}

    @hookimpl
    def stream_state_bytes(self) -> int:
        glue = self._current_glue()
        return glue.stream_state.made(glue.device) if glue is not None else 0

    @hookimpl
    def replay(self, graph: Any) -> None:
        self._torch("replay").replay(graph)

    @hookimpl
    def release_graph(self, graph: Any) -> None:
        self._torch("release_graph").release_graph(graph)


class ExtensionHooks(TorchHooks):
    """Mixin for a backend over a vendor library (VMM) and a torch extension (an :class:`ExtensionGlue`).

    The backend names the library's two queries, makes its native calls through ``_call``, queries
    both granularities when it opens (``_granularity``) and keeps its library loaded for the process.
    """

    glue: TorchGlue | None
    #: ``{recommended: bytes}``, queried once when the backend opens
    _granularity: dict[bool, int]
    #: the native function that counts the devices, and the ctypes type of its one output
    count_devices: ClassVar[tuple[str, type]]
    #: the native function of free and total memory, its arguments before those two outputs, and their ctypes type
    read_mem_info: ClassVar[tuple[str, tuple[Any, ...], type]]

    def _call(self, call: str, native: str, *args: Any) -> None:
        """Call ``native(*args)`` on behalf of hook ``call``, raising the hal error when it fails."""
        raise NotImplementedError

    def _outputs(self, call: str, native: str, leading: tuple[Any, ...], ctype: type, count: int) -> list[int]:
        """The values ``native(*leading, &out1, ... &out<count>)`` writes to its ``ctype`` outputs."""
        outs = [ctype(0) for _ in range(count)]
        self._call(call, native, *leading, *(ctypes.byref(out) for out in outs))
        return [out.value for out in outs]

    @hookimpl
    def device_count(self) -> int:
        native, ctype = self.count_devices
        return self._outputs("device_count", native, (), ctype, 1)[0]

    @hookimpl
    def mem_info(self) -> MemInfo:
        native, leading, ctype = self.read_mem_info
        free, total = self._outputs("mem_info", native, leading, ctype, 2)
        return MemInfo(free=free, total=total)

    def capability_report(self) -> tuple[str | None, dict[str, str]]:
        """The torch extension in use (None without one) and why each capability is on or off."""
        return extension_report(self.glue, self.torch_extension)

    @hookimpl
    def granularity(self, recommended: bool) -> int:
        return self._granularity[bool(recommended)]

    @hookimpl
    def use_pool(self, pool: Any) -> AbstractContextManager[None]:
        return cast(ExtensionGlue, self._torch("use_pool")).use_pool(pool)

    @hookimpl
    def shutdown(self) -> None:
        """Nothing to do: the library stays loaded (and initialised) for the process; the facade released
        everything else."""
