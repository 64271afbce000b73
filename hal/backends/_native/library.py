"""A vendor library loaded with ctypes, whose every return code is checked in one place.

A vendor subclass names its prototypes, its success code, what a usable
library must offer, how a failed code becomes a hal error and how the library
is initialised. Its structs, enum values and code tables stay with it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from hal.errors import BackendUnavailableError, DeviceOutOfMemoryError, DriverError, HalError, InvalidArgumentError


class NativeOutOfMemoryError(DriverError, DeviceOutOfMemoryError):
    """The vendor's out-of-memory code: a :class:`hal.DeviceOutOfMemoryError` that keeps the native code."""


class NativeInvalidArgumentError(DriverError, InvalidArgumentError):
    """The vendor refused an argument: a :class:`hal.InvalidArgumentError` that keeps the native code."""


@dataclass(frozen=True)
class ErrorClasses:
    """The :class:`hal.DriverError` classes a backend raises for each kind of failed code."""

    other: type[DriverError] = DriverError
    out_of_memory: type[DriverError] = NativeOutOfMemoryError
    invalid_argument: type[DriverError] = NativeInvalidArgumentError


def native_error(code: int, call: str | None, native: str, *, backend: str, code_name: str | None,
                 out_of_memory: bool = False, invalid_argument: bool = False, explanation: str = "",
                 context: str = "", classes: ErrorClasses = ErrorClasses()) -> DriverError:
    """The hal error for a failed ``native`` call made on behalf of hook ``call``: every vendor's.

    :param code_name: the vendor's name for ``code``, if it has one.
    :param out_of_memory: the vendor says ``code`` means out of memory.
    :param invalid_argument: the vendor says ``code`` means a refused argument.
    :param explanation: the vendor's text for the failure, if it gave one.
    :param context: what the call was about (``"stream=0x..."``), if the caller says.
    """
    cls = (classes.out_of_memory if out_of_memory else classes.invalid_argument if invalid_argument
           else classes.other)
    where = f" ({context})" if context else ""
    message = f"{native}{where} failed" + (f": {explanation}" if explanation else "")
    return cls(message, backend=backend, call=call, code=code, code_name=code_name, native_call=native)


class NativeLibrary:
    """One loaded vendor library: typed functions and :meth:`call`, which checks every return code."""

    #: the backend's name, as errors carry it
    backend: ClassVar[str]
    #: functions the library must export, with their argument types (all return ``int``)
    prototypes: ClassVar[Mapping[str, list[Any]]]
    #: functions bound only where the library exports them (see :meth:`has`)
    optional: ClassVar[Mapping[str, list[Any]]] = {}
    #: the code that means success
    success: ClassVar[int]
    #: what a library lacking ``prototypes`` is not, e.g. "a CANN runtime with the VMM API"
    requirement: ClassVar[str]

    def __init__(self, path: str) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(path)
        missing = [n for n in self.prototypes if not hasattr(self.cdll, n)]
        if missing:
            raise BackendUnavailableError(f"{path} lacks {', '.join(missing)} ({self.requirement} is needed)",
                                          backend=self.backend)
        self._fns: dict[str, Any] = {}
        for name, argtypes in {**self.prototypes, **self.optional}.items():
            if hasattr(self.cdll, name):
                fn = getattr(self.cdll, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name] = fn
        self._init_lock = threading.Lock()
        self._initialized = False

    def has(self, name: str) -> bool:
        """Whether the library exports the (optional) function ``name``."""
        return name in self._fns

    def call(self, call: str, native: str, *args: Any, allow: tuple[int, ...] = ()) -> int:
        """Call ``native(*args)`` for hook ``call``; raise the hal error unless it succeeded.

        :param allow: further codes that count as success (returned to the caller).
        """
        code = self._fns[native](*args)
        if code == self.success or code in allow:
            return code
        raise self.error_for(code, call, native)

    def error_for(self, code: int, call: str, native: str) -> HalError:
        """The hal error for a failed call (the vendor's code table decides)."""
        raise NotImplementedError

    def init_once(self) -> None:
        """:meth:`initialize` once per library and process."""
        with self._init_lock:
            if not self._initialized:
                self.initialize()
                self._initialized = True

    def initialize(self) -> None:
        """The vendor's initialisation call."""
        raise NotImplementedError


L = TypeVar("L", bound=NativeLibrary)


class LibraryCache(Generic[L]):
    """Libraries of one kind, loaded once per process and path."""

    def __init__(self, factory: Callable[[str], L]) -> None:
        self._factory = factory
        self._libraries: dict[str, L] = {}
        self._lock = threading.Lock()

    def load(self, path: str) -> L:
        """The library at ``path``, loaded on first use.

        :raises OSError: the library cannot be loaded.
        :raises BackendUnavailableError: it lacks the VMM functions.
        """
        with self._lock:
            lib = self._libraries.get(path)
            if lib is None:
                lib = self._libraries[path] = self._factory(path)
            return lib
