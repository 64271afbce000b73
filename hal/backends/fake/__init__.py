"""``fake``: a host-memory device with real aliasing, so the whole suite runs on a CPU."""

from hal.backends.fake.backend import FakeBackend, set_device

__all__ = ["FakeBackend", "set_device"]
