"""The calls into one backend plugin, with the conventions of :mod:`hal.api`.

:class:`HookCalls` is the part of :class:`hal.Backend` that owns the plugin
manager: the backend plugin registered next to hal's accounting and fault
injector (and the tracer, with ``HAL_TRACE``), which hooks it implements, the
capabilities it keeps, and how a hook's result or failure is checked: a
missing hook or an absent capability raises :class:`hal.UnsupportedError`
naming the backend, the call and the capability, and a ``None`` from a hook
that must return a value is a broken plugin (:class:`hal.PluginValidationError`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from hal import api
from hal.errors import HalError, InvalidArgumentError, InvalidStateError, PluginValidationError, UnsupportedError
from hal.types import MemInfo
from hal.wrappers import Accounting, FaultInjector, LiveCounts, install_tracing

log = logging.getLogger("hal")

#: sizes and addresses are 64-bit in every driver: larger ones would wrap
ADDRESS_LIMIT = 1 << 64


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _mem_info(value: Any) -> bool:
    return isinstance(value, MemInfo)


class HookCalls:
    """One backend plugin behind a pluggy manager of its own, called by the contract's conventions.

    Owns the manager and its wrapper plugins (``accounting``, ``faults``,
    tracing), the set of hooks the plugin implements, the capabilities it
    keeps, and whether the backend is closed.
    """

    def __init__(self, name: str, plugin: Any, *, device: int = 0, origin: str = "built-in") -> None:
        self.name = name
        self.device = device
        self.origin = origin
        self.plugin = plugin
        self._pm = pluggy.PluginManager("hal")
        self._pm.add_hookspecs(api)
        self.accounting = Accounting()
        self.faults = FaultInjector(name)
        self._pm.register(self.accounting, name="hal-accounting")
        self._pm.register(self.faults, name="hal-faults")
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginValidationError(f"plugin does not fit the hal contract: {exc}", backend=name) from exc
        self._untrace = install_tracing(self._pm, name) if os.environ.get("HAL_TRACE") else None
        self._hook = self._pm.hook
        self._replay_cache: tuple[int, Callable[[Any], Any] | None] | None = None
        self._implemented = frozenset(
            caller.name for caller in self._pm.get_hookcallers(plugin) or () if caller.name in api.ALL_HOOKS
        )
        self._lock = threading.RLock()  # the bookkeeping of the calls, and close()
        self._closed = False
        self._pid = os.getpid()  # the process it serves: a fork child gets a backend of its own
        self._granularity: int | None = None
        self._capabilities: frozenset[str] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def capturing(self) -> bool:
        """Whether the current stream of this thread captures a graph on this backend's device now.

        Declared here for every part of :class:`hal.Backend` (a wait before an unmap must not end a capture);
        the stream calls answer it (:meth:`hal.stream_calls.StreamCalls.capturing`). A part without streams
        captures nothing.
        """
        return False

    @contextlib.contextmanager
    def count_calls(self) -> Iterator[collections.Counter[str]]:
        """Inside the block, every call of a hook on this backend (any thread) is counted by hook name: what an
        operation costs in driver calls.

        >>> with be.count_calls() as calls:
        ...     saver.pause()
        >>> calls["unmap"], calls["synchronize"]
        """
        calls: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def before(hook_name: str, impls: Any, kwargs: Any) -> None:
            with lock:
                calls[hook_name] += 1

        undo = self._pm.add_hookcall_monitoring(before, lambda *args: None)
        try:
            yield calls
        finally:
            undo()

    @property
    def forked(self) -> bool:
        """Whether this is a fork child of the process that made the backend: it serves none of its calls here."""
        return self._pid != os.getpid()

    def _forget_in_fork_child(self) -> bool:
        """In a fork child: mark the backend closed without a call into the plugin (everything it holds is the
        parent's); whether that was the case."""
        if not self.forked:
            return False
        log.debug("%s: close() in a fork child of process %d forgets the backend (its memory is the parent's)",
                  self.name, self._pid)
        self._closed = True
        return True

    def _shut_down(self, collect: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        """Close's last step: the plugin's ``shutdown`` hook (inside ``collect()``, which keeps a failure);
        every call refuses from then on."""
        with collect(), self._plugin_faults("shutdown"):
            if "shutdown" in self._implemented:
                self._hook.shutdown()
        self._closed = True
        if self._untrace is not None:
            self._untrace()

    # -- helpers ----------------------------------------------------------

    def _err(self, cls: type[HalError], call: str, message: str) -> HalError:
        return cls(message, backend=self.name, call=call)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise self._err(InvalidStateError, call, "the backend is closed; get a new one with hal.get_backend()")
        if self._pid != os.getpid():
            raise self._err(InvalidStateError, call, f"this backend was made in process {self._pid} and this is a "
                            "fork child of it: a device context does not survive a fork, and the memory the backend "
                            "maps is the parent's (on fake, chunks a child wrote through would change the parent's "
                            "graph memory). Get a backend of the child's own with hal.get_backend()")

    def _check_ptr(self, call: str, ptr: Any) -> None:
        if not isinstance(ptr, int) or isinstance(ptr, bool) or not 0 <= ptr < ADDRESS_LIMIT:
            raise self._err(InvalidArgumentError, call, f"ptr={ptr!r} must be an int address in [0, 2**64)")

    def _require(self, hook: str) -> None:
        if hook not in self._implemented:
            capability = api.HOOK_CAPABILITY.get(hook)
            needs = f"; it is part of the {capability!r} capability" if capability else ""
            has = ", ".join(sorted(self.capabilities)) or "none"
            raise self._err(UnsupportedError, hook,
                            f"this backend does not implement it{needs} (the backend's capabilities: {has})")

    def _result(self, hook: str, value: Any) -> Any:
        """``value``, unless a hook that must return something returned ``None`` (a broken plugin)."""
        if value is None and hook in api.RESULT_HOOKS:
            raise self._err(PluginValidationError, hook,
                            "the backend returned None; a hook it cannot serve must be left out or raise "
                            "hal.UnsupportedError (see hal.api)")
        return value

    @contextlib.contextmanager
    def _plugin_faults(self, hook: str) -> Iterator[None]:
        """What else than a hal error the plugin's ``hook`` raises leaves as :class:`PluginValidationError`
        (a hook raises hal errors only): callers that pass a broken plugin over catch hal errors."""
        try:
            yield
        except HalError:
            raise
        except Exception as exc:
            raise self._err(PluginValidationError, hook, f"the plugin's {hook}() raised {type(exc).__name__}: "
                                                         f"{exc} (a hook raises hal errors only)") from exc

    def _refuse_without(self, capability: str, call: str, what: str) -> None:
        if capability not in self.capabilities:
            raise self._err(UnsupportedError, call, f"{what} (capability {capability!r} is absent)")

    # -- queries ----------------------------------------------------------

    def _query(self, hook: str, check: Callable[[Any], bool], wants: str, **kwargs: Any) -> Any:
        """Ask the plugin's query ``hook`` (on an open backend): whatever else than a hal error it raises, or an
        answer that fails ``check``, leaves as :class:`PluginValidationError` naming the plugin and the hook, so
        that discovery and selection pass a broken plugin over as they do one whose constructor fails."""
        self._check_open(hook)
        with self._plugin_faults(hook):
            value = self._result(hook, getattr(self._hook, hook)(**kwargs))
        if not check(value):
            raise self._err(PluginValidationError, hook, f"the backend returned {value!r}; a hook answers {wants}")
        return value

    @property
    def granularity(self) -> int:
        """Minimum physical granularity in bytes; every vmm size is a multiple of it (asked once, then kept:
        it stays readable after :meth:`close`)."""
        if self._granularity is None:
            self._granularity = self._query("granularity", _positive_int, "an int > 0 (bytes)", recommended=False)
        return self._granularity

    @property
    def recommended_granularity(self) -> int:
        """The granularity the driver recommends (a multiple of :attr:`granularity`)."""
        return int(self._query("granularity", _positive_int, "an int > 0 (bytes)", recommended=True))

    def device_count(self) -> int:
        """How many devices this backend sees."""
        return int(self._query("device_count", _count, "an int >= 0"))

    def mem_info(self) -> MemInfo:
        """Free and total device memory, as the driver sees it."""
        return self._query("mem_info", _mem_info, "a hal.types.MemInfo")

    @property
    def live(self) -> LiveCounts:
        """What is live now (ranges, chunks, mappings, pools, graphs), per the accounting wrapper."""
        return self.accounting.snapshot()

    # -- capabilities ---------------------------------------------------

    @property
    def capabilities(self) -> frozenset[str]:
        """What the backend can do beyond vmm (names of :data:`hal.api.CAPABILITIES`).

        What the backend declares, less any capability whose hooks it does not
        all implement (logged once: that is a bug in the plugin).
        """
        if self._capabilities is None:
            declared: frozenset[str] = frozenset()
            if "capabilities" in self._implemented:
                with self._plugin_faults("capabilities"):
                    declared = frozenset(self._result("capabilities", self._hook.capabilities()))
            kept = set()
            for capability in declared:
                missing = [h for h in api.CAPABILITY_HOOKS.get(capability, ()) if h not in self._implemented]
                if missing:
                    log.warning("%s: declares capability %r but does not implement %s; ignored", self.name,
                                capability, ", ".join(missing))
                else:
                    kept.add(capability)
            self._capabilities = frozenset(kept)
        return self._capabilities

    def supports(self, capability: str) -> bool:
        """Whether ``capability`` is in :attr:`capabilities`."""
        return capability in self.capabilities

    def implements(self, hook: str) -> bool:
        """Whether the backend implements ``hook`` (a name of :data:`hal.api.ALL_HOOKS`)."""
        if hook not in api.ALL_HOOKS:
            raise self._err(InvalidArgumentError, "implements", f"hook={hook!r} is not a hook of the hal contract")
        return hook in self._implemented

    # -- calling hooks ----------------------------------------------------

    def _graph_call(self, hook: str, **kwargs: Any) -> Any:
        self._check_open(hook)
        self._require(hook)
        return self._result(hook, getattr(self._hook, hook)(**kwargs))

    def _direct_replay(self) -> Callable[[Any], Any] | None:
        """The plugin's own ``replay`` where nothing else would see the call (replay is a hot path): no fault
        is armed for it, no tracing, and no plugin but the backend and hal's fault injector implements it."""
        if self._untrace is not None or self.faults.armed("replay"):
            return None
        plugins = len(self._pm.get_plugins())  # the answer holds until a plugin is registered or unregistered
        cached = self._replay_cache
        if cached is not None and cached[0] == plugins:
            return cached[1]
        impls = self._hook.replay.get_hookimpls()
        direct = None
        if len(impls) == 2 and {impl.plugin for impl in impls} == {self.plugin, self.faults}:
            direct = next(impl.function for impl in impls if impl.plugin is self.plugin)
        self._replay_cache = (plugins, direct)
        return direct
