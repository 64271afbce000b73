"""The fake backend's graph: the public host recorder (:mod:`hal.host.tape`) under its former names."""

from hal.host.tape import (  # noqa: F401 - former names
    HOST_READ_METHODS,
    HOST_SYNC_OPS,
    Placer,
    _compile,
    _materialise,
    _out_variant,
    _Recorder,
    capture,
    place,
    tensor_at,
)
from hal.host.tape import HostGraph as FakeGraph

__all__ = ["HOST_READ_METHODS", "HOST_SYNC_OPS", "FakeGraph", "Placer", "capture", "place", "tensor_at"]
