"""hal: a plugin-based hardware layer for device virtual memory and graphs.

>>> import hal
>>> be = hal.get_backend("fake", granularity=1 << 16)
>>> h = be.create_phy_mem_handle(be.granularity)
>>> graphs = hal.get_backend(requires=("graphs",))  # the best backend that can capture graphs
"""

from hal.api import CAPABILITIES, hookimpl
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
    UseAfterUnmapError,
)
from hal.facade import Backend
from hal.registry import get_backend, list_backends
from hal.routing import route_every_capture
from hal.transaction import Transaction
from hal.types import ALLOCATION_ALIGNMENT, BackendInfo, GraphAddresses, MemInfo
from hal.wrappers import LiveCounts

__version__ = "0.1.0"

__all__ = [
    "ALLOCATION_ALIGNMENT",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "CAPABILITIES",
    "CaptureError",
    "DeviceOutOfMemoryError",
    "DriverError",
    "GraphAddresses",
    "HalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "LiveCounts",
    "MemInfo",
    "PluginValidationError",
    "Transaction",
    "UnsupportedError",
    "UseAfterUnmapError",
    "get_backend",
    "hookimpl",
    "list_backends",
    "route_every_capture",
]
