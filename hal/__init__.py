"""hal: a plugin-based hardware layer for device virtual memory and graphs.

>>> import hal
>>> be = hal.get_backend("fake", granularity=1 << 16)
>>> h = be.create_phy_mem_handle(be.granularity)
"""

from hal.api import hookimpl
from hal.errors import (
    BackendUnavailableError,
    CaptureError,
    DeviceOutOfMemoryError,
    DriverError,
    HalError,
    InvalidArgumentError,
    InvalidStateError,
    PluginValidationError,
    UnsupportedError,
)
from hal.facade import Backend
from hal.registry import get_backend, list_backends
from hal.types import BackendInfo, MemInfo
from hal.wrappers import LiveCounts

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CaptureError",
    "DeviceOutOfMemoryError",
    "DriverError",
    "HalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "LiveCounts",
    "MemInfo",
    "PluginValidationError",
    "UnsupportedError",
    "get_backend",
    "hookimpl",
    "list_backends",
]
