"""``fake``: a host-memory device with real aliasing, so the whole suite runs on a CPU."""

from hal.backends.fake.backend import FakeBackend

__all__ = ["FakeBackend"]
