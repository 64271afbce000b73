"""Wrapper plugins registered next to the backend on the facade's manager.

* :class:`Accounting` counts live ranges, chunks, mappings, pools and graphs,
  so tests (and users) can prove nothing leaked;
* :class:`FaultInjector` makes the k-th call of a hook fail with a chosen error;
* :func:`install_tracing` logs every contract call with its arguments, result
  and duration (on when ``HAL_TRACE`` is set).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from hal import api
from hal.api import hookimpl
from hal.errors import DriverError, InvalidArgumentError

log = logging.getLogger("hal.trace")


@dataclass(frozen=True)
class LiveCounts:
    """A snapshot of :class:`Accounting`."""

    ranges: int
    chunks: int
    mappings: int
    mapped_bytes: int
    chunk_bytes: int
    reserved_bytes: int
    pools: int
    graphs: int

    @property
    def zero(self) -> bool:
        """True when nothing at all is live."""
        return not any(vars(self).values())


class Accounting:
    """Counts what is live, from the results of successful contract calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ranges: dict[int, int] = {}
        self.chunks: dict[Any, int] = {}
        self.mappings: dict[int, int] = {}
        self.pools = _Tracked()
        self.graphs = _Tracked()
        self.calls: Counter[str] = Counter()

    def snapshot(self) -> LiveCounts:
        with self._lock:
            return LiveCounts(
                ranges=len(self.ranges),
                chunks=len(self.chunks),
                mappings=len(self.mappings),
                mapped_bytes=sum(self.mappings.values()),
                chunk_bytes=sum(self.chunks.values()),
                reserved_bytes=sum(self.ranges.values()),
                pools=len(self.pools),
                graphs=len(self.graphs),
            )

    def _made(self, hook: str | None, live: Any, size: int = 0) -> Generator[None, Any, Any]:
        """Wrap one call of a hook that makes something: record its result as live (with ``size``)."""
        made = yield
        with self._lock:
            live[made] = size
            if hook is not None:
                self.calls[hook] += 1
        return made

    def _gone(self, hook: str | None, live: Any, key: Any) -> Generator[None, None, None]:
        """Wrap one call of a hook that releases ``key``: forget it once the call succeeded."""
        result = yield
        with self._lock:
            live.pop(key, None)
            if hook is not None:
                self.calls[hook] += 1
        return result

    @hookimpl(wrapper=True)
    def create_vir_ptr(self, size: int) -> Generator[None, int, int]:
        return (yield from self._made("create_vir_ptr", self.ranges, size))

    @hookimpl(wrapper=True)
    def release_vir_ptr(self, ptr: int) -> Generator[None, None, None]:
        return (yield from self._gone("release_vir_ptr", self.ranges, ptr))

    @hookimpl(wrapper=True)
    def create_phy_mem_handle(self, size: int) -> Generator[None, Any, Any]:
        return (yield from self._made("create_phy_mem_handle", self.chunks, size))

    @hookimpl(wrapper=True)
    def release_phy_mem_handle(self, handle: Any) -> Generator[None, None, None]:
        return (yield from self._gone("release_phy_mem_handle", self.chunks, handle))

    @hookimpl(wrapper=True)
    def import_phy_mem_handle(self, size: int) -> Generator[None, Any, Any]:
        return (yield from self._made("import_phy_mem_handle", self.chunks, size))

    @hookimpl(wrapper=True)
    def map(self, ptr: int, size: int) -> Generator[None, None, None]:
        result = yield
        with self._lock:
            self.mappings[ptr] = size
            self.calls["map"] += 1
        return result

    @hookimpl(wrapper=True)
    def unmap(self, ptr: int) -> Generator[None, None, None]:
        return (yield from self._gone("unmap", self.mappings, ptr))

    @hookimpl(wrapper=True)
    def create_pool(self) -> Generator[None, Any, Any]:
        return (yield from self._made(None, self.pools))

    @hookimpl(wrapper=True)
    def release_pool(self, pool: Any) -> Generator[None, None, None]:
        return (yield from self._gone(None, self.pools, pool))

    @hookimpl(wrapper=True)
    def create_graph(self) -> Generator[None, Any, Any]:
        return (yield from self._made(None, self.graphs))

    @hookimpl(wrapper=True)
    def release_graph(self, graph: Any) -> Generator[None, None, None]:
        return (yield from self._gone(None, self.graphs, graph))


class _Tracked:
    """Objects made and not yet released, tracked by identity, never by a reusable ``id()``.

    An object dropped without release stays counted (it was never released)
    even after the garbage collector took it and its ``id`` went to another
    object. Objects that take weak references are held weakly, others strongly.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, list[Any]] = {}  # id at creation -> [weakref or object]
        self._count = 0

    def __setitem__(self, obj: Any, _size: int) -> None:
        self.add(obj)

    def pop(self, obj: Any, _default: None = None) -> None:
        self.discard(obj)

    def add(self, obj: Any) -> None:
        try:
            ref: Any = weakref.ref(obj)
        except TypeError:
            ref = lambda obj=obj: obj  # noqa: E731 - no weak reference: hold it
        self._by_id.setdefault(id(obj), []).append(ref)
        self._count += 1

    def discard(self, obj: Any) -> None:
        refs = self._by_id.get(id(obj), [])
        for i, ref in enumerate(refs):
            if ref() is obj:
                del refs[i]
                if not refs:
                    del self._by_id[id(obj)]
                self._count -= 1
                return

    def __len__(self) -> int:
        return self._count

    def alive(self) -> list[Any]:
        """The tracked objects still alive (not released, not collected)."""
        return [obj for refs in self._by_id.values() for ref in refs if (obj := ref()) is not None]

    def clear(self) -> None:
        self._by_id.clear()
        self._count = 0


@dataclass
class _Rule:
    hook: str
    nth: int
    error: BaseException | None
    seen: int = 0
    fired: bool = False


class FaultInjector:
    """Makes the k-th call of a hook raise, before the backend sees it.

    >>> be.faults.fail("map", nth=2)            # the 2nd map from now fails
    >>> be.faults.fail("create_phy_mem_handle", error=hal.DeviceOutOfMemoryError("full"))

    Rules fire once; :meth:`clear` drops the rest. ``fired`` lists what fired.
    """

    def __init__(self, backend_name: str) -> None:
        self._backend_name = backend_name
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.fired: list[str] = []

    def fail(self, hook: str, nth: int = 1, error: BaseException | None = None) -> None:
        """Make the ``nth`` call of ``hook`` (counted from now) raise ``error``.

        The default error is a :class:`~hal.DriverError` that says it was injected.
        """
        if hook not in api.ALL_HOOKS:
            raise InvalidArgumentError(f"hook={hook!r} is not a hook of the hal contract", backend=self._backend_name,
                                       call="faults.fail")
        if not isinstance(nth, int) or isinstance(nth, bool) or nth < 1:
            raise InvalidArgumentError(f"nth={nth!r} must be an int >= 1", backend=self._backend_name,
                                       call="faults.fail")
        with self._lock:
            self._rules.append(_Rule(hook, nth, error))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def armed(self, hook: str) -> bool:
        """Whether a rule for ``hook`` has yet to fire (read without the lock: a rule being added races the call
        it was added for anyway)."""
        return any(r.hook == hook and not r.fired for r in self._rules)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(not r.fired for r in self._rules)

    def _check(self, hook: str) -> None:
        with self._lock:
            for rule in self._rules:
                if rule.hook != hook or rule.fired:
                    continue
                rule.seen += 1
                if rule.seen == rule.nth:
                    rule.fired = True
                    self.fired.append(hook)
                    error = rule.error or DriverError(
                        f"fault injected into call {rule.nth}",
                        backend=self._backend_name,
                        call=hook,
                        code=-1,
                        code_name="HAL_INJECTED_FAULT",
                    )
                    raise error


def _fault_wrapper(name: str) -> Callable[..., Any]:
    @hookimpl(wrapper=True, tryfirst=True, specname=name)
    def wrapper(self: FaultInjector) -> Generator[None, Any, Any]:
        self._check(name)
        return (yield)

    wrapper.__name__ = f"fault_{name}"
    return wrapper


for _name in api.ALL_HOOKS:
    setattr(FaultInjector, f"fault_{_name}", _fault_wrapper(_name))


def install_tracing(pm: pluggy.PluginManager, backend_name: str) -> Callable[[], None]:
    """Log every hook call on ``pm`` at DEBUG level on logger ``hal.trace``.

    Returns the function that turns tracing off again.
    """
    starts: dict[tuple[int, str], float] = {}

    def before(hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        starts[(threading.get_ident(), hook_name)] = time.perf_counter()

    def after(outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, Any]) -> None:
        t0 = starts.pop((threading.get_ident(), hook_name), time.perf_counter())
        us = (time.perf_counter() - t0) * 1e6
        args = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
        exc = outcome.exception
        if exc is not None:
            log.debug("%s.%s(%s) raised %s: %s [%.1f us]", backend_name, hook_name, args,
                      type(exc).__name__, exc, us)
        else:
            log.debug("%s.%s(%s) -> %s [%.1f us]", backend_name, hook_name, args,
                      _short(outcome.get_result()), us)

    return pm.add_hookcall_monitoring(before, after)


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 4096:
        return hex(value)
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


__all__ = ["Accounting", "FaultInjector", "LiveCounts", "install_tracing"]
