"""What a backend can do, as far as the conformance suite is concerned.

Like SQLAlchemy's ``Requirements``: every field turns a group of suite tests
on or off. A plugin author states them on the plugin class::

    class MyBackend:
        hal_requirements = {"host_accessible": False}

and a user can override them on the command line with
``--hal-option host_accessible=false`` (keys that name a field configure the
suite, not the backend).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Requirements:
    """Optional properties of a backend that decide which suite tests run."""

    host_accessible: bool = True
    """Mapped device memory can be read and written by the host at its
    virtual address (``ctypes.memmove``). When ``False`` the byte tests go
    through torch tensors on the backend's ``torch_device()`` instead, or
    are skipped with a reason."""

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Names of the fields (the keys ``--hal-option`` hands to the suite)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_overrides(self, overrides: Mapping[str, Any], source: str) -> Requirements:
        """Return a copy with ``overrides`` applied; reject unknown keys and wrong types."""
        known = {f.name: f for f in dataclasses.fields(self)}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"{source}: unknown requirement {key!r}; known: {', '.join(known)}")
            if known[key].type in ("bool", bool):
                if value not in (True, False, 0, 1):
                    raise ValueError(f"{source}: requirement {key}={value!r} must be true or false")
                value = bool(value)
            values[key] = value
        return dataclasses.replace(self, **values)

    @classmethod
    def for_plugin(cls, plugin: Any, overrides: Mapping[str, Any] | None = None) -> Requirements:
        """The requirements a backend plugin (its class or an instance) declares (``hal_requirements``), then
        ``overrides``."""
        req = cls()
        declared = getattr(plugin, "hal_requirements", None)
        if declared:
            owner = plugin if isinstance(plugin, type) else type(plugin)  # the class or an instance of it
            req = req.with_overrides(declared, f"{owner.__name__}.hal_requirements")
        if overrides:
            req = req.with_overrides(overrides, "--hal-option")
        return req
