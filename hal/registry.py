"""Backend discovery and selection.

Built-in backends are listed here by import path, so probing them never
imports a vendor stack that is absent. Third-party backends are found
through the ``hal.backends`` entry-point group; the entry point names the
backend and points at its plugin class.

A backend class has a ``probe()`` classmethod returning ``None`` when the
backend can be used here, or the reason it cannot; it is instantiated as
``cls(device=..., **options)`` and its methods marked ``@hal.hookimpl``
implement :mod:`hal.api`.

Selection by capability: what a backend can do (:data:`hal.api.CAPABILITIES`)
is known only once it is constructed, so ``get_backend(requires=...)``
without a name constructs the available backends in priority order, keeps
the first that has every required capability and closes the others.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from hal import api
from hal.errors import (
    BackendUnavailableError,
    HalError,
    InvalidArgumentError,
    PluginValidationError,
    UnsupportedError,
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
REQUIRED_HOOKS = api.REQUIRED_HOOKS


class _PluginClass(Protocol):
    """A backend plugin class as the registry uses it (what :func:`validate_plugin_class` checks)."""

    def probe(self) -> str | None:
        """``None`` when the backend can run here, else why not (a classmethod of the plugin)."""

    def __call__(self, device: int, **options: Any) -> Any:
        """Construct the plugin for ``device``."""


@dataclass
class _Entry:
    name: str
    priority: int
    origin: str
    loader: Any  # callable returning the class
    cls: _PluginClass | None = None
    error: str | None = None
    """Why the plugin cannot be loaded, without the ``name:`` prefix the raised error adds."""

    def load(self) -> _PluginClass:
        if self.cls is None and self.error is None:
            try:
                cls = self.loader()
                validate_plugin_class(self.name, cls)
                self.cls = cls
            except PluginValidationError as exc:
                self.error = exc.message
            except Exception as exc:  # noqa: BLE001 - a broken third-party package must not break listing
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
        unknown = sorted(h for h in _hook_names(pm, cls) if h not in api.ALL_HOOKS)
        detail = f"unknown hook(s) {', '.join(unknown)}" if unknown else str(exc)
        raise PluginValidationError(
            f"plugin {plugin_name} does not fit the hal contract: {detail}", backend=name
        ) from exc
    implemented = {caller.name for caller in pm.get_hookcallers(cls) or ()}
    missing = [h for h in REQUIRED_HOOKS if h not in implemented]
    if missing:
        raise PluginValidationError(
            f"plugin {plugin_name} does not implement required hook(s): {', '.join(missing)}",
            backend=name,
        )
    if not callable(getattr(cls, "probe", None)):
        raise PluginValidationError(f"plugin {plugin_name} has no probe() classmethod", backend=name)


def _hook_names(pm: pluggy.PluginManager, cls: Any) -> list[str]:
    """The hook names ``cls`` implements (``specname`` applied), read through pluggy's public parser."""
    names = []
    for attr in dir(cls):
        try:
            opts = pm.parse_hookimpl_opts(cls, attr)
        except Exception:  # noqa: BLE001 - a descriptor that fails on the class is no hook
            continue
        if opts is not None:
            names.append(opts.get("specname") or attr)
    return names


def _probe(entry: _Entry) -> str | None:
    try:
        cls = entry.load()
    except PluginValidationError as exc:
        return exc.message
    try:
        return cls.probe()
    except Exception as exc:  # noqa: BLE001 - a probe must never break discovery
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


def required_capabilities(requires: Iterable[str]) -> frozenset[str]:
    """Check ``requires`` (capability names; one name as a str is fine) and return them as a set.

    :raises InvalidArgumentError: not an iterable of known capability names.
    """
    names = (requires,) if isinstance(requires, str) else requires
    try:
        needed = frozenset(names)
    except TypeError:
        raise InvalidArgumentError(f"requires={requires!r} must be an iterable of capability names",
                                   call="get_backend") from None
    unknown = sorted(repr(n) for n in needed if n not in api.CAPABILITIES)
    if unknown:
        raise InvalidArgumentError(f"requires: unknown capability {', '.join(unknown)}; known: "
                                   f"{', '.join(sorted(api.CAPABILITIES))}", call="get_backend")
    return needed


def select_backend_name(name: str | None = None, *, requires: Iterable[str] = (), device: int = 0) -> str:
    """Resolve a backend name: explicit, else ``HAL_BACKEND``, else the first available.

    With ``requires``, the name is checked to have those capabilities (an
    explicit one or ``$HAL_BACKEND``; :class:`hal.UnsupportedError` if not),
    or is the first available backend that has them; this constructs
    backends for ``device`` to ask them, and closes them again.
    """
    needed = required_capabilities(requires)
    if not needed:
        if name:
            return name
        env = os.environ.get("HAL_BACKEND")
        if env:
            return env
        for info in list_backends():
            if info.available:
                return info.name
        raise BackendUnavailableError("no backend is available (not even 'fake')")
    be = get_backend(name, device, requires=needed)
    be.close()
    return be.name


def get_backend(name: str | None = None, device: int = 0, *, requires: Iterable[str] = (),
                **options: Any) -> Backend:
    """Return a :class:`hal.Backend` for ``device`` of the chosen backend.

    :param name: backend name; when ``None``, ``$HAL_BACKEND``, else the first
        available backend by priority (cuda, ascend, mlu, third-party, fake)
        that has every capability in ``requires``.
    :param device: device index.
    :param requires: capability names the backend must have (``"graphs"``,
        ``"custom_pool"``, ``"capture_routing"``, ``"use_pool"``: see
        :data:`hal.api.CAPABILITIES`). Without a name, backends lacking one
        are passed over (they are constructed to ask, then closed).
    :param options: backend options (``fake``: ``granularity``, ``capacity``,
        ``device_count``), given to whichever backend is tried.
    :raises BackendUnavailableError: unknown or unavailable backend, with the reason.
    :raises UnsupportedError: the named backend (or every available one)
        lacks a required capability; the message says which lacks what.
    :raises InvalidArgumentError: an option the backend does not know, a bad
        value, or an unknown capability name.
    """
    needed = required_capabilities(requires)
    named = name or os.environ.get("HAL_BACKEND")
    if named or not needed:
        be = _open(select_backend_name(name), device, options)
        _check_capabilities(be, needed, by_env=not name)
        return be
    lacking: list[str] = []
    for info in list_backends():
        if not info.available:
            continue
        try:
            be = _open(info.name, device, options)
        except BackendUnavailableError as exc:  # probed fine, but cannot start here
            lacking.append(f"{info.name} cannot start ({exc.message})")
            continue
        missing = needed - be.capabilities
        if not missing:
            _report_passed_over(lacking, be.name)
            return be
        be.close()
        lacking.append(f"{info.name} lacks {', '.join(sorted(missing))}")
    raise UnsupportedError(f"no available backend has the capabilities {', '.join(sorted(needed))}: "
                           f"{'; '.join(lacking) or 'none is available'}", call="get_backend")


_passed_over_reported: set[tuple[str, ...]] = set()


def _report_passed_over(lacking: list[str], chosen: str) -> None:
    """Warn (once per process for the same story) that preferred backends were passed over for ``chosen``.

    A device backend lacking a capability would otherwise give way to
    ``fake`` (host memory) without a word.
    """
    story = (*lacking, chosen)
    if lacking and story not in _passed_over_reported:
        _passed_over_reported.add(story)
        log.warning("using backend %s for the required capabilities: %s", chosen, "; ".join(lacking))


def _check_capabilities(be: Backend, needed: frozenset[str], *, by_env: bool) -> None:
    """Close ``be`` and raise :class:`UnsupportedError` when it lacks one of ``needed``."""
    missing = needed - be.capabilities
    if not missing:
        return
    has = ", ".join(sorted(be.capabilities)) or "none"
    try:
        be.close()
    except HalError as exc:  # the capability error is the one to report
        log.warning("%s: close() after a capability check failed: %s", be.name, exc)
    advice = ("$HAL_BACKEND names it: set it to another backend, or unset it" if by_env
              else "name another backend, or none")
    raise UnsupportedError(
        f"lacks the required capabilit{'y' if len(missing) == 1 else 'ies'} {', '.join(sorted(missing))} "
        f"(it has: {has}); {advice} to let hal choose one that has them", backend=be.name, call="get_backend")


def _open(chosen: str, device: int, options: dict[str, Any]) -> Backend:
    """Construct backend ``chosen`` for ``device`` with ``options``, behind a facade."""
    from hal.facade import Backend

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
