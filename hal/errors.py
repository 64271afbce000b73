"""The one error hierarchy of hal.

Every error names the backend and the contract call it came from; a
:class:`DriverError` also keeps the native code (and its name when the
vendor library gives one), so a user can look it up in the vendor's docs.
"""

from __future__ import annotations

import copy


class HalError(Exception):
    """Base class of every error raised by hal and its backends."""

    def __init__(self, message: str, *, backend: str | None = None, call: str | None = None) -> None:
        self.backend = backend
        self.call = call
        self.message = message
        """The explanation alone, without the ``backend.call:`` prefix (to wrap it without repeating it)."""
        prefix = ".".join(p for p in (backend, call) if p)
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def led_by(self, what: str) -> HalError:
        """The same error -- its class, backend, call and native code -- with its explanation led by ``what``
        (for a caller that adds what it was doing: ``raise exc.led_by("key 3: ...") from exc``)."""
        again = copy.copy(self)
        again.message = f"{what}: {self.message}"
        prefix = ".".join(p for p in (self.backend, self.call) if p)
        again.args = (f"{prefix}: {again.message}" if prefix else again.message,)
        return again


class InvalidArgumentError(HalError, ValueError):
    """An argument was refused before (or by) the driver: wrong size, alignment, range."""


class InvalidStateError(HalError):
    """The call does not fit the object's state: double release, unmap of an unmapped range."""


class UseAfterUnmapError(InvalidStateError):
    """An unmap (or the release of a chunk still mapped) that did not wait for device work queued over the range.

    A device runs behind the host: a kernel or a graph replay queued before the unmap may still read or
    write the range, and a driver need not wait for it (a GPU then faults and the process is lost). The
    asynchronous ``fake`` (option ``asynchronous``, ``HAL_FAKE_ASYNC=1``) raises this instead, naming the
    range and the work; nothing is unmapped then. Synchronize the device (or the streams that used the
    range) first, or unmap with ``wait=True``.
    """


class DeviceOutOfMemoryError(HalError, MemoryError):
    """The device (or the configured capacity of a simulated one) has no room left."""


class BackendUnavailableError(HalError):
    """The backend cannot be used on this machine; the message says why."""


class PluginValidationError(HalError):
    """A backend plugin does not fit the contract (e.g. it implements an unknown hook)."""


class CaptureError(HalError, RuntimeError):
    """A graph capture failed or was refused (host synchronisation inside a capture, exhausted streams...).

    Also a :class:`RuntimeError`, as the frameworks' own capture errors are: a caller that falls back to
    eager execution when a capture raises ``RuntimeError`` catches hal's and graphkit's refusals too.
    """


class UnsupportedError(HalError, NotImplementedError):
    """The backend lacks the hook or the capability the call needs (see ``Backend.capabilities``)."""


class DriverError(HalError):
    """A native call failed; keeps the backend, the call, the native code and the native function."""

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        call: str | None = None,
        code: int | None = None,
        code_name: str | None = None,
        native_call: str | None = None,
    ) -> None:
        self.code = code
        self.code_name = code_name
        self.native_call = native_call
        """The vendor function that failed (``cuMemMap``, ``aclrtMapMem``...), where one did."""
        native = ""
        if code is not None:
            native = f" [{code_name} = {code}]" if code_name else f" [native code {code}]"
        super().__init__(message + native, backend=backend, call=call)


__all__ = [
    "HalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "UseAfterUnmapError",
    "DeviceOutOfMemoryError",
    "BackendUnavailableError",
    "PluginValidationError",
    "CaptureError",
    "DriverError",
    "UnsupportedError",
]
