"""Backend discovery and selection.

Built-in backends are listed here by import path, so probing them never
imports a vendor stack that is absent. Third-party backends are found
through the ``hal.backends`` entry-point group; the entry point names the
backend and points at its plugin class.

A backend class has a ``probe()`` classmethod returning ``None`` when the
backend can be used here, or the reason it cannot; it is instantiated as
``cls(device=..., **options)`` and its methods marked ``@hal.hookimpl``
implement :mod:`hal.api`.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from hal import api
from hal.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    PluginValidationError,
)
from hal.types import BackendInfo

if TYPE_CHECKING:  # pragma: no cover
    from hal.facade import Backend

log = logging.getLogger("hal")

ENTRY_POINT_GROUP = "hal.backends"
THIRD_PARTY_PRIORITY = 100

#: name -> (import path, priority)
BUILTINS: dict[str, tuple[str, int]] = {
    "cuda": ("hal.backends.cuda:CudaBackend", 10),
    "ascend": ("hal.backends.ascend:AscendBackend", 20),
    "mlu": ("hal.backends.mlu:MluBackend", 30),
    "fake": ("hal.backends.fake:FakeBackend", 1000),
}

#: hooks a backend must implement; the graph hooks are optional (capabilities)
REQUIRED_HOOKS = ("device_count", "granularity", "mem_info", *api.VMM_HOOKS)


@dataclass
class _Entry:
    name: str
    priority: int
    origin: str
    loader: Any  # callable returning the class
    cls: type | None = None
    error: str | None = None

    def load(self) -> type:
        if self.cls is None and self.error is None:
            try:
                self.cls = self.loader()
                validate_plugin_class(self.name, self.cls)
            except PluginValidationError as exc:
                self.error = str(exc)
            except Exception as exc:  # a broken third-party package must not break listing
                self.error = f"failed to load: {type(exc).__name__}: {exc}"
        if self.error is not None:
            raise PluginValidationError(self.error, backend=self.name)
        assert self.cls is not None
        return self.cls


_lock = threading.Lock()
_entries: dict[str, _Entry] | None = None


def _import_path(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _discover() -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for name, (path, prio) in BUILTINS.items():
        entries[name] = _Entry(name, prio, "built-in", lambda p=path: _import_path(p))
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in entries:
            log.warning("hal: entry point %s (%s) shadows an existing backend; ignored", ep.name, ep.value)
            continue
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else ep.value
        entries[ep.name] = _Entry(ep.name, THIRD_PARTY_PRIORITY, origin, ep.load)
    return entries


def _all(refresh: bool = False) -> dict[str, _Entry]:
    global _entries
    with _lock:
        if _entries is None or refresh:
            _entries = _discover()
        return _entries


def validate_plugin_class(name: str, cls: Any) -> None:
    """Check that ``cls`` fits the contract; raise :class:`PluginValidationError` if not."""
    pm = pluggy.PluginManager("hal")
    pm.add_hookspecs(api)
    plugin_name = f"{name} ({getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)})"
    try:
        pm.register(cls, name=plugin_name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        hooks = sorted(
            h for h in dir(cls)
            if getattr(getattr(cls, h, None), "hal_impl", None) is not None
            and (getattr(getattr(cls, h), "hal_impl").get("specname") or h) not in api.ALL_HOOKS
        )
        detail = f"unknown hook(s) {', '.join(hooks)}" if hooks else str(exc)
        raise PluginValidationError(
            f"plugin {plugin_name} does not fit the hal contract: {detail}", backend=name
        ) from exc
    implemented = {impl_hook for impl_hook in api.ALL_HOOKS
                   if getattr(pm.hook, impl_hook).get_hookimpls()}
    missing = [h for h in REQUIRED_HOOKS if h not in implemented]
    if missing:
        raise PluginValidationError(
            f"plugin {plugin_name} does not implement required hook(s): {', '.join(missing)}",
            backend=name,
        )
    if not callable(getattr(cls, "probe", None)):
        raise PluginValidationError(f"plugin {plugin_name} has no probe() classmethod", backend=name)


def _probe(entry: _Entry) -> str | None:
    try:
        cls = entry.load()
    except PluginValidationError as exc:
        return str(exc)
    try:
        return cls.probe()
    except Exception as exc:  # a probe must never break discovery
        return f"probe failed: {type(exc).__name__}: {exc}"


_probe_cache: dict[str, str | None] = {}


def list_backends(refresh: bool = False) -> list[BackendInfo]:
    """Every known backend with its availability, the reason when unavailable, and its origin.

    Sorted by priority (the order automatic selection tries them in). Probes
    are cached; ``refresh=True`` discovers and probes again.
    """
    entries = _all(refresh)
    if refresh:
        _probe_cache.clear()
    infos = []
    for entry in sorted(entries.values(), key=lambda e: (e.priority, e.name)):
        if entry.name not in _probe_cache:
            _probe_cache[entry.name] = _probe(entry)
        reason = _probe_cache[entry.name]
        infos.append(BackendInfo(entry.name, reason is None, reason or "", entry.origin, entry.priority))
    return infos


def select_backend_name(name: str | None = None) -> str:
    """Resolve a backend name: explicit, else ``HAL_BACKEND``, else the first available."""
    if name:
        return name
    env = os.environ.get("HAL_BACKEND")
    if env:
        return env
    for info in list_backends():
        if info.available:
            return info.name
    raise BackendUnavailableError("no backend is available (not even 'fake')")


def get_backend(name: str | None = None, device: int = 0, **options: Any) -> "Backend":
    """Return a :class:`hal.Backend` for ``device`` of the chosen backend.

    :param name: backend name; when ``None``, ``$HAL_BACKEND``, else the first
        available backend by priority (cuda, ascend, mlu, third-party, fake).
    :param device: device index.
    :param options: backend options (``fake``: ``granularity``, ``capacity``,
        ``device_count``).
    :raises BackendUnavailableError: unknown or unavailable backend, with the reason.
    :raises InvalidArgumentError: an option the backend does not know, or a bad value.
    """
    from hal.facade import Backend

    chosen = select_backend_name(name)
    entries = _all()
    if chosen not in entries:
        known = ", ".join(sorted(entries))
        raise BackendUnavailableError(f"unknown backend {chosen!r}; known backends: {known}")
    entry = entries[chosen]
    cls = entry.load()
    if chosen not in _probe_cache:
        _probe_cache[chosen] = _probe(entry)
    reason = _probe_cache[chosen]
    if reason is not None:
        raise BackendUnavailableError(f"backend is not available: {reason}", backend=chosen)
    if not isinstance(device, int) or device < 0:
        raise InvalidArgumentError(f"device={device!r} must be a non-negative int", backend=chosen,
                                   call="get_backend")
    try:
        plugin = cls(device=device, **options)
    except TypeError as exc:
        raise InvalidArgumentError(f"bad options {sorted(options)}: {exc}", backend=chosen,
                                   call="get_backend") from exc
    return Backend(chosen, plugin, device=device, origin=entry.origin)
