"""Backend discovery and selection.

Built-in backends are listed here by import path, so probing them never
imports a vendor stack that is absent. Third-party backends are found
through the ``hal.backends`` entry-point group; the entry point names the
backend and points at its plugin class.

A backend class has a ``probe()`` classmethod returning ``None`` when the
backend can be used here, or the reason it cannot; it is instantiated as
``cls(device=..., **options)`` and its methods marked ``@hal.hookimpl``
implement :mod:`hal.api`. A plugin class may set ``hal_priority`` (an int
from :data:`THIRD_PARTY_PRIORITY` up; ``fake`` is 1000) to be tried later.

Discovery never breaks: whatever a plugin's import, probe or constructor
raises (``SystemExit`` included) makes that plugin unavailable with the
reason, and a third-party probe that does not answer within
``$HAL_PROBE_TIMEOUT`` seconds (default :data:`PROBE_TIMEOUT`) is given up on.

Selection without a name walks the backends in priority order and stops at
the first that can serve: a backend is probed only when it is reached, one
whose class lacks the hooks of a required capability is passed over without
being probed, and one whose constructor fails (with any error but
:class:`hal.InvalidArgumentError`, which is the caller's) or whose
``capabilities()`` fails gives way to the next.
What a backend can do (:data:`hal.api.CAPABILITIES`) is known only once it
is constructed, so ``get_backend(requires=...)`` constructs the candidates,
keeps the first that has every required capability and closes the others.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
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
from hal.plugin_class import current_device
from hal.plugin_class import raised as _raised
from hal.types import BackendInfo

if TYPE_CHECKING:  # pragma: no cover
    from hal.facade import Backend

log = logging.getLogger("hal")

ENTRY_POINT_GROUP = "hal.backends"
#: Priority of a third-party plugin that declares none; a plugin may declare a larger ``hal_priority``.
THIRD_PARTY_PRIORITY = 100
#: Seconds a third-party probe may take before it is given up on (``$HAL_PROBE_TIMEOUT`` overrides).
PROBE_TIMEOUT = 5.0
PROBE_TIMEOUT_ENV = "HAL_PROBE_TIMEOUT"
#: What a plugin's import, probe or constructor may raise without breaking discovery.
PLUGIN_FAILURES = (Exception, SystemExit)

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
    hooks: frozenset[str] = frozenset()
    """The hooks the class implements (known once it is loaded)."""

    @property
    def builtin(self) -> bool:
        return self.origin == "built-in"

    def load(self) -> _PluginClass:
        if self.cls is None and self.error is None:
            try:
                cls = self.loader()
                validate_plugin_class(self.name, cls)
                self.cls = cls
                self.hooks = frozenset(_hook_names(_contract_manager(), cls))
                if not self.builtin:
                    self.priority = getattr(cls, "hal_priority", THIRD_PARTY_PRIORITY)
            except PluginValidationError as exc:
                self.error = exc.message
            except PLUGIN_FAILURES as exc:  # a broken third-party package must not break listing
                self.error = f"failed to load: {_raised(exc)}"
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
            log.warning("entry point %s (%s) shadows an existing backend; ignored", ep.name, ep.value)
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


def _contract_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("hal")
    pm.add_hookspecs(api)
    return pm


def expected_signature(hook: str) -> str:
    """How a plugin method implementing ``hook`` is written: ``def unmap(self, ptr: int, size: int) -> None``."""
    sig = inspect.signature(getattr(api, hook))
    params = ", ".join(["self", *(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
                                  for p in sig.parameters.values())])
    returns = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation}"
    return f"def {hook}({params}){returns}"


def _hookimpls(pm: pluggy.PluginManager, cls: Any) -> Iterator[tuple[str, str]]:
    """``(attribute, hook name)`` of each hook ``cls`` implements (``specname`` applied), read through
    pluggy's public parser."""
    for attr in dir(cls):
        try:
            opts = pm.parse_hookimpl_opts(cls, attr)
        except Exception:  # noqa: BLE001 - a descriptor that fails on the class is no hook
            continue
        if opts is not None:
            yield attr, opts.get("specname") or attr


def _unmarked(pm: pluggy.PluginManager, cls: Any) -> list[str]:
    """What to say of each method of ``cls`` named after a hook but not marked ``@hal.hookimpl``: an override
    of an inherited hook (``capabilities``, say) written without the marker hides the hook from hal."""
    problems = []
    for hook in api.ALL_HOOKS:
        method = getattr(cls, hook, None)
        if not callable(method) or isinstance(method, type) or pm.parse_hookimpl_opts(cls, hook) is not None:
            continue
        lost = ("the backend has no capabilities at all" if hook == "capabilities"
                else f"the backend does not implement {hook}")
        problems.append(f"method {hook} is named after a hook but not marked @hal.hookimpl, so hal does not see it "
                        f"and {lost}: put @hal.hookimpl above 'def {hook}' (an override of an inherited hook "
                        "needs the marker again)")
    return problems


def _misfits(pm: pluggy.PluginManager, cls: Any) -> list[str]:
    """What is wrong with the hooks ``cls`` implements, each with what to write instead."""
    problems = _unmarked(pm, cls)
    for attr, hook in _hookimpls(pm, cls):
        if hook not in api.ALL_HOOKS:
            close = difflib.get_close_matches(hook, api.ALL_HOOKS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; the hooks are: {', '.join(api.ALL_HOOKS)}"
            problems.append(f"unknown hook {hook}{hint}")
            continue
        try:
            params = list(inspect.signature(getattr(cls, attr)).parameters.values())
        except (TypeError, ValueError):
            continue
        names = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        wanted = set(inspect.signature(getattr(api, hook)).parameters)
        extra = [n for n in names if n not in wanted]
        if extra:
            problems.append(f"hook {hook} takes argument(s) {', '.join(extra)} that the contract does not have; "
                            f"expected {expected_signature(hook)} (arguments may be left out, not renamed)")
    return problems


def validate_plugin_class(name: str, cls: Any) -> None:
    """Check that ``cls`` fits the contract; raise :class:`PluginValidationError` saying what to change if not."""
    if not isinstance(cls, type):
        raise PluginValidationError(f"the entry point names {cls!r} (of type {type(cls).__name__}), not a class: "
                                    "point "
                                    "it at the plugin class ('package.module:ClassName')", backend=name)
    pm = _contract_manager()
    plugin_name = f"{name} ({getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)})"
    misfits = _misfits(pm, cls)
    try:
        pm.register(cls, name=plugin_name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        detail = "; ".join(misfits) or str(exc)
        raise PluginValidationError(
            f"plugin {plugin_name} does not fit the hal contract: {detail}", backend=name
        ) from exc
    if misfits:
        raise PluginValidationError(f"plugin {plugin_name} does not fit the hal contract: {'; '.join(misfits)}",
                                    backend=name)
    implemented = {caller.name for caller in pm.get_hookcallers(cls) or ()}
    missing = [h for h in REQUIRED_HOOKS if h not in implemented]
    if missing:
        raise PluginValidationError(
            f"plugin {plugin_name} does not implement required hook(s): {', '.join(missing)}",
            backend=name,
        )
    probe = inspect.getattr_static(cls, "probe", None)
    if not callable(getattr(cls, "probe", None)):
        raise PluginValidationError(f"plugin {plugin_name} has no probe() classmethod: add "
                                    "'@classmethod def probe(cls) -> str | None' (None: usable here; a str: "
                                    "why not)", backend=name)
    if inspect.isfunction(probe):
        raise PluginValidationError(f"plugin {plugin_name}: make probe a classmethod (put @classmethod above "
                                    "'def probe(cls)'); hal calls it on the class, before any instance exists",
                                    backend=name)
    _check_constructor(name, plugin_name, cls)
    priority = getattr(cls, "hal_priority", THIRD_PARTY_PRIORITY)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < THIRD_PARTY_PRIORITY:
        raise PluginValidationError(f"plugin {plugin_name}: hal_priority={priority!r} must be an int >= "
                                    f"{THIRD_PARTY_PRIORITY} (larger is tried later; fake is "
                                    f"{BUILTINS['fake'][1]})", backend=name)


def _check_constructor(name: str, plugin_name: str, cls: type) -> None:
    """Refuse a class that cannot be built as ``cls(device=N)``."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C type): find out at construction
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    device = next((p for p in params if p.name == "device"), None)
    if device is None or device.kind is device.POSITIONAL_ONLY:
        raise PluginValidationError(
            f"plugin {plugin_name}: the constructor must accept device= (hal builds the plugin as "
            "cls(device=N, **options)): write 'def __init__(self, device: int = 0, *, option=default, ...)'",
            backend=name)
    others = [p.name for p in params if p is not device and p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if others:
        raise PluginValidationError(
            f"plugin {plugin_name}: the constructor's argument(s) {', '.join(others)} need a default: hal builds "
            "the plugin as cls(device=N) unless the user passes options", backend=name)


def _hook_names(pm: pluggy.PluginManager, cls: Any) -> list[str]:
    """The hook names ``cls`` implements (``specname`` applied)."""
    return [hook for _, hook in _hookimpls(pm, cls)]


def plugin_class(name: str) -> Any:
    """The plugin class of backend ``name``, loaded (neither probed nor constructed).

    :raises BackendUnavailableError: no backend has that name.
    :raises PluginValidationError: its class cannot be loaded or does not fit the contract.
    """
    entry = _all().get(name)
    if entry is None:
        raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {', '.join(sorted(_all()))}")
    return entry.load()


def probe_timeout() -> float:
    """Seconds a third-party probe may take: ``$HAL_PROBE_TIMEOUT``, else :data:`PROBE_TIMEOUT`."""
    text = os.environ.get(PROBE_TIMEOUT_ENV)
    if not text:
        return PROBE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        log.warning("$%s=%r is not a positive number of seconds; using %g", PROBE_TIMEOUT_ENV, text, PROBE_TIMEOUT)
        return PROBE_TIMEOUT
    return value


def _answer(value: Any) -> str | None:
    """A probe's return value as an availability reason (None: available)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip():
        return value
    return (f"probe() returned {value!r}; it must return None when the backend can be used here, "
            "else a non-empty str saying why not")


class _ProbeCall:
    """One probe running on a daemon thread, so that a probe that hangs cannot hang its caller."""

    def __init__(self, entry: _Entry, cls: _PluginClass) -> None:
        self.started = time.monotonic()
        self.reason: str | None = None
        self.done = threading.Event()
        self.name = entry.name
        threading.Thread(target=self._run, args=(cls,), name=f"hal-probe-{entry.name}", daemon=True).start()

    def _run(self, cls: _PluginClass) -> None:
        try:
            self.reason = _answer(cls.probe())
        except BaseException as exc:  # not an undo: on its own thread, its error is the plugin's  # noqa: BLE001
            self.reason = f"probe failed: {_raised(exc)}"
        finally:
            self.done.set()

    def result(self, timeout: float) -> str | None:
        if not self.done.wait(max(0.0, self.started + timeout - time.monotonic())):
            log.warning("the probe of backend %s did not answer within %g s; it is listed unavailable",
                        self.name, timeout)
            return (f"probe() did not answer within {timeout:g} s and was given up on (a probe must be cheap; "
                    f"${PROBE_TIMEOUT_ENV} sets the limit)")
        return self.reason


def _start_probe(entry: _Entry) -> _ProbeCall | str | None:
    """Start probing ``entry``: a running call for a third-party plugin, else the answer itself."""
    try:
        cls = entry.load()
    except PluginValidationError as exc:
        return exc.message
    if not entry.builtin:
        return _ProbeCall(entry, cls)
    try:
        return _answer(cls.probe())
    except PLUGIN_FAILURES as exc:  # a probe must never break discovery
        return f"probe failed: {_raised(exc)}"


def _probe(entry: _Entry) -> str | None:
    """``entry``'s availability reason (None: available), probed once per process and remembered."""
    if entry.name not in _probe_cache:
        started = _start_probe(entry)
        _probe_cache[entry.name] = started.result(probe_timeout()) if isinstance(started, _ProbeCall) else started
    return _probe_cache[entry.name]


_probe_cache: dict[str, str | None] = {}


def list_backends(refresh: bool = False) -> list[BackendInfo]:
    """Every known backend with its availability, the reason when unavailable, and its origin.

    Sorted by priority (the order automatic selection tries them in). Probes
    are cached; ``refresh=True`` discovers and probes again.
    """
    entries = _all(refresh)
    if refresh:
        _probe_cache.clear()
    # every probe not yet answered starts now, so plugins that hang cost one timeout together
    started = {e.name: _start_probe(e) for e in entries.values() if e.name not in _probe_cache}
    for name, answer in started.items():
        _probe_cache[name] = answer.result(probe_timeout()) if isinstance(answer, _ProbeCall) else answer
    infos = []
    for entry in _by_priority(entries):
        reason = _probe_cache[entry.name]
        infos.append(BackendInfo(entry.name, reason is None, reason or "", entry.origin, entry.priority))
    return infos


def _by_priority(entries: dict[str, _Entry]) -> list[_Entry]:
    """Every entry, loaded (a plugin's ``hal_priority`` is known then), in the order selection tries them."""
    for entry in entries.values():
        with contextlib.suppress(PluginValidationError):  # listed unavailable with the reason
            entry.load()
    return sorted(entries.values(), key=lambda e: (e.priority, e.name))


def _could_have(entry: _Entry, needed: frozenset[str]) -> bool:
    """Whether ``entry``'s class implements the hooks of every capability in ``needed`` (no probe needed)."""
    if not needed:
        return True
    if "capabilities" not in entry.hooks:
        return False
    return all(set(api.CAPABILITY_HOOKS[c]) <= entry.hooks for c in needed)


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


def select_backend_name(name: str | None = None, *, requires: Iterable[str] = (), device: int | None = None) -> str:
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
        for entry in _by_priority(_all()):
            if _probe(entry) is None:
                return entry.name
        raise BackendUnavailableError("no backend is available (not even 'fake')")
    be = get_backend(name, device, requires=needed)
    be.close()
    return be.name


def get_backend(name: str | None = None, device: int | None = None, *, requires: Iterable[str] = (),
                **options: Any) -> Backend:
    """Return a :class:`hal.Backend` for ``device`` of the chosen backend.

    :param name: backend name; when ``None``, ``$HAL_BACKEND``, else the first
        available backend by priority (lowest first: cuda 10, ascend 20,
        mlu 30, a plugin 100 or its ``hal_priority``, fake 1000) that has
        every capability in ``requires``.
    :param device: device index; ``None`` (the default): the backend's current
        device, as torch means it (``torch.cuda.current_device()`` once CUDA is
        initialised in this process, else 0; hal initialises nothing to find it).
    :param requires: capability names the backend must have (``"graphs"``,
        ``"custom_pool"``, ``"capture_routing"``, ``"use_pool"``: see
        :data:`hal.api.CAPABILITIES`). Without a name, backends lacking one
        are passed over: a class without the capability's hooks unprobed,
        the others constructed to ask, then closed. A backend whose
        constructor fails (any error but :class:`InvalidArgumentError`) or
        whose ``capabilities()`` or ``granularity()`` fails (or answers no
        granularity) gives way to the next one.
    :param options: backend options (``fake``: ``granularity``, ``capacity``,
        ``device_count``), given to whichever backend is tried.
    :raises BackendUnavailableError: unknown or unavailable backend, with the reason.
    :raises UnsupportedError: the named backend (or every available one)
        lacks a required capability; the message says which lacks what.
    :raises InvalidArgumentError: an option the backend does not know, a bad
        value, or an unknown capability name.
    """
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"name={name!r} must be a backend name (a str) or None", call="get_backend")
    needed = required_capabilities(requires)
    named = name or os.environ.get("HAL_BACKEND")
    if named:
        be = _open(named, device, options)
        _check_capabilities(be, needed, by_env=not name)
        return be
    lacking: list[str] = []
    for entry in _candidates(needed, lacking):
        try:
            be = _open(entry.name, device, options)
        except InvalidArgumentError:
            raise  # the caller's options or device index: no other backend makes them right
        except HalError as exc:  # probed fine, but cannot start here (unavailable, a driver error, no memory)
            lacking.append(f"{entry.name} cannot start ({exc.message})")
            continue
        why = _lacks(be, needed)
        if why is None:
            _report_passed_over(lacking, be.name)
            return be
        lacking.append(f"{entry.name} {why}")
    if not needed:
        raise BackendUnavailableError(f"no backend can be used here: {'; '.join(lacking) or 'none is available'}",
                                      call="get_backend")
    raise UnsupportedError(f"no available backend has the capabilities {', '.join(sorted(needed))}: "
                           f"{'; '.join(lacking) or 'none is available'}", call="get_backend")


def _lacks(be: Backend, needed: frozenset[str]) -> str | None:
    """None when ``be`` has every capability in ``needed`` and tells its granularity (what every use asks
    first); else why not, and ``be`` is closed."""
    try:
        missing = needed - be.capabilities
        why = f"lacks {', '.join(sorted(missing))}" if missing else None
    except HalError as exc:  # a broken capabilities(): passed over, as a backend lacking them is
        why = f"cannot say what it can do ({exc.message})"
    if why is None:
        try:
            be.granularity  # noqa: B018 - asked once and kept; a plugin that cannot answer is of no use
        except HalError as exc:
            why = f"cannot say its granularity ({exc.message})"
    if why is not None:
        try:
            be.close()
        except HalError as exc:  # the plugin is passed over anyway; its shutdown's fault is only told
            log.warning("%s: close() of a backend passed over failed: %s", be.name, exc)
    return why


def _candidates(needed: frozenset[str], lacking: list[str]) -> Iterator[_Entry]:
    """The available entries that could have ``needed``, in priority order, each probed only when reached.

    Those passed over without a probe (their class lacks the hooks) are noted in ``lacking``.
    """
    for entry in _by_priority(_all()):
        if entry.error is not None:
            continue
        if not _could_have(entry, needed):
            if not entry.builtin:
                lacking.append(f"{entry.name} lacks {', '.join(sorted(needed))} (its class lacks the hooks)")
            continue
        if _probe(entry) is None:
            yield entry


def dropped_capabilities(be: Backend) -> list[str]:
    """Why each capability that ``be``'s plugin declares is not in ``be.capabilities``, with the fix."""
    if not be.implements("capabilities"):
        return []
    declared = be.plugin.capabilities()
    problems = []
    for capability in sorted(set(declared) - be.capabilities):
        missing = [h for h in api.CAPABILITY_HOOKS[capability] if not be.implements(h)]
        problems.append(f"declares capability {capability!r} but does not implement {', '.join(missing)}: implement "
                        f"{'it' if len(missing) == 1 else 'them'} or leave {capability!r} out of capabilities()")
    for capability in sorted(set(declared) - api.CAPABILITIES):
        close = difflib.get_close_matches(capability, api.CAPABILITIES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(f"declares unknown capability {capability!r} (hal ignores it); {hint}known: "
                        f"{', '.join(sorted(api.CAPABILITIES))}")
    return problems


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
    if not needed:  # nothing to ask: a plugin whose capabilities() fails is still usable by name
        return
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


def _open(chosen: str, device: int | None, options: dict[str, Any]) -> Backend:
    """Construct backend ``chosen`` for ``device`` (None: its current device) with ``options``, behind a facade."""
    from hal.facade import Backend

    entries = _all()
    if chosen not in entries:
        known = ", ".join(sorted(entries))
        raise BackendUnavailableError(f"unknown backend {chosen!r}; known backends: {known}")
    entry = entries[chosen]
    cls = entry.load()
    reason = _probe(entry)
    if reason is not None:
        raise BackendUnavailableError(f"backend is not available: {reason}", backend=chosen)
    if device is None:
        device = current_device(cls)
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise InvalidArgumentError(f"device={device!r} must be a non-negative int (or None: the current device)",
                                   backend=chosen, call="get_backend")
    try:
        inspect.signature(cls).bind(device=device, **options)
    except TypeError as exc:
        raise InvalidArgumentError(f"bad options {sorted(options)}: {exc}", backend=chosen,
                                   call="get_backend") from exc
    except ValueError:  # no signature to read: the constructor itself tells
        pass
    try:
        plugin = cls(device=device, **options)
    except HalError:
        raise
    except PLUGIN_FAILURES as exc:
        # a bug or a failed driver start in the plugin: unavailable from now on, with the reason
        why = f"its constructor raised {_raised(exc)}"
        _probe_cache[chosen] = why
        log.warning("backend %s is unavailable: %s", chosen, why)
        raise BackendUnavailableError(f"backend is not available: {why}", backend=chosen,
                                      call="get_backend") from exc
    return Backend(chosen, plugin, device=device, origin=entry.origin)
