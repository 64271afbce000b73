"""The start-up hook of ``GRAPHKIT_GRAPH_MEMORY``: the switch starts once the process has imported ``torch``.

``graphkit-startup.pth``, installed into site-packages with the package, imports
this module while the interpreter starts, in every Python process that starts
with the variable set (an engine's workers, ranks and schedulers among them),
and calls :func:`install`. That registers an import hook and returns: nothing
of graphkit is imported yet (graphkit imports torch) and no device is touched.
When ``torch`` has finished importing -- and again when ``torch_npu`` or
``torch_mlu`` has, to route their graph classes too -- it calls the
switch's entry point, :data:`SWITCH` (:func:`graphkit.switch.plugin`), by
name, as a ``.pth`` file or a console script names its target: this module
depends on nothing of graphkit, and ``graphkit.switch`` reads the variable's
name and values here. The hook waits while ``hal`` or ``graphkit`` is half
imported (they import torch themselves).

Written by hand rather than with a post-import hook library: it runs in every
process of the environment while the interpreter starts, so it may import the
standard library alone, and little of that (``logging`` only once it has
something to say). It never raises: a failure is logged once and the process
carries on without the switch.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

#: the variable that turns the switch on (``graphkit.switch`` reads it from here)
ENV = "GRAPHKIT_GRAPH_MEMORY"
#: the values that leave it off, and those that turn it on with the default options
OFF = ("", "0", "false", "off", "no")
ON = ("1", "true", "on", "yes")
#: the switch starts when one of these has finished importing
TRIGGERS = ("torch", "torch_npu", "torch_mlu")
#: ... and not while one of these is half imported: starting the switch imports them
IMPORTERS = ("hal", "graphkit")
#: the switch's entry point, ``module:function``, imported and called once a trigger has finished importing
SWITCH = "graphkit.switch:plugin"
_LOGGER = "graphkit.switch"


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the variable asks for the switch (a bad value does too: the switch reports it)."""
    return environ.get(ENV, "").strip().lower() not in OFF


class _Loader:
    """The loader of a watched module: puts the module's own loader back, runs it, then tells the hook."""

    def __init__(self, hook: StartupHook, real: object) -> None:
        self.hook, self.real = hook, real

    def __getattr__(self, name: str) -> object:  # what else the real loader answers (get_code, is_package...)
        return getattr(self.real, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.real, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self.real  # type: ignore[assignment]
        module.__loader__ = self.real  # type: ignore[assignment]
        self.hook.started()
        done = False
        try:
            self.real.exec_module(module)  # type: ignore[attr-defined]
            done = True
        finally:
            self.hook.finished(module.__name__, done)


class StartupHook:
    """A :data:`sys.meta_path` finder that calls ``on_ready`` when a trigger module has finished importing and
    no importer module is half imported (in any thread), never from inside ``on_ready`` itself.

    It finds nothing itself: it asks the finders after it and wraps the loader they return.
    """

    graphkit_startup_hook = True  # what install() looks for (another copy of this module may have made one)

    def __init__(self, on_ready: Callable[[], None], triggers: Sequence[str] = TRIGGERS,
                 importers: Sequence[str] = IMPORTERS) -> None:
        self.on_ready, self.triggers, self.watched = on_ready, tuple(triggers), (*triggers, *importers)
        self._lock = threading.Lock()
        self._finding = threading.local()
        self._importing = 0
        self._pending = self._running = False

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        """The spec the other finders give for a watched module, with its loader wrapped; None otherwise."""
        if name not in self.watched:
            return None
        finding: set[str] | None = getattr(self._finding, "names", None)
        if finding is None:
            finding = self._finding.names = set()
        if name in finding:  # a finder after this one asks the import system again
            return None
        finding.add(name)
        try:
            spec = self._others(name, path, target)
        finally:
            finding.discard(name)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(self, spec.loader)  # type: ignore[assignment]
        return spec

    def _others(self, name: str, path: Sequence[str] | None, target: ModuleType | None) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                return spec
        return None

    def started(self) -> None:
        with self._lock:
            self._importing += 1

    def finished(self, name: str, done: bool) -> None:
        """A watched module's import ended (``done``: without an error)."""
        with self._lock:
            self._importing -= 1
        self.settle(done and name in self.triggers)

    def settle(self, triggered: bool = False) -> None:
        """Run ``on_ready`` if a trigger finished (now or before) and no watched import is under way."""
        with self._lock:
            self._pending |= triggered
            run = self._pending and self._importing == 0 and not self._running
            if run:
                self._pending, self._running = False, True
        if not run:
            return
        try:
            self.on_ready()
        except Exception:  # the import of torch must not fail because of the switch  # noqa: BLE001
            _warn_once("the graph memory switch did not start", exc_info=True)
        finally:
            with self._lock:
                self._running = False


_warned = False


def _warn_once(message: str, *, exc_info: bool = False) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    import logging

    logging.getLogger(_LOGGER).warning("%s=%r: %s in process %d", ENV, os.environ.get(ENV), message, os.getpid(),
                                       exc_info=exc_info)


def start_switch() -> None:
    """Start the switch through its entry point :data:`SWITCH` (torch is imported by now); errors are logged
    once by the switch, never raised."""
    module, _, function = SWITCH.partition(":")
    getattr(importlib.import_module(module), function)()


def install(on_ready: Callable[[], None] = start_switch) -> StartupHook | None:
    """Register the hook when the variable asks for it (once per process, however often this is called); the
    hook, or None. Never raises."""
    try:
        if not requested():
            return None
        for finder in sys.meta_path:
            if getattr(finder, "graphkit_startup_hook", False):
                return finder  # type: ignore[return-value]
        hook = StartupHook(on_ready)
        sys.meta_path.insert(0, hook)
        hook.settle(any(name in sys.modules for name in TRIGGERS))  # torch imported before this ran
        return hook
    except Exception:  # a start-up hook must never stop the interpreter  # noqa: BLE001
        _warn_once("the start-up hook failed", exc_info=True)
        return None
