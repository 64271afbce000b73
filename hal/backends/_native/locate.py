"""Where a vendor library is, and the vendor-neutral part of the cheap probe.

Search order: the ``library=`` option, then ``$HAL_<VENDOR>_LIBRARY``, then
``$<HOME>/lib64/<soname>``, then the plain soname through the loader path.
Whether the torch extension is installed is answered by
``importlib.util.find_spec``: the probe never imports it.

Availability: at the default location a backend needs both the library and
its torch extension. With ``$HAL_<VENDOR>_LIBRARY`` (a runtime, a driver or a
simulator named on purpose) the library alone is enough: the VMM hooks work
and the ``"graphs"`` capability is absent while the extension is missing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from hal.backends._native.library import NativeLibrary
from hal.errors import BackendUnavailableError

L = TypeVar("L", bound=NativeLibrary)


@dataclass(frozen=True)
class LibrarySpec:
    """One vendor's runtime library and torch extension, by name."""

    #: the backend's name, as errors carry it
    backend: str
    #: the library's file name, e.g. ``libascendcl.so``
    soname: str
    #: variable that names the library itself (a runtime or a simulator)
    env_library: str
    #: variable that names the vendor's install root (``lib64/<soname>`` below it)
    env_home: str
    #: what usually sets ``env_home``, for the hint in the error
    home_hint: str
    #: the torch extension's module name, e.g. ``torch_npu``
    extension: str

    def extension_installed(self) -> bool:
        """Whether the torch extension can be imported (without importing it)."""
        if self.extension in sys.modules:
            return sys.modules[self.extension] is not None
        try:
            return importlib.util.find_spec(self.extension) is not None
        except (ImportError, ValueError):
            return False

    def candidates(self, explicit: str | None = None) -> list[str]:
        """Paths (or sonames) to try, in order."""
        if explicit:
            return [explicit]
        override = os.environ.get(self.env_library)
        if override:
            return [override]
        home = os.environ.get(self.env_home)
        return ([os.path.join(home, "lib64", self.soname)] if home else []) + [self.soname]

    def open(self, load: Callable[[str], L], explicit: str | None = None) -> L:
        """``load`` the first candidate that loads.

        :raises BackendUnavailableError: none loads (the message says where it looked and how to
            point at a library), or the one found lacks the VMM API.
        """
        problems = []
        for path in self.candidates(explicit):
            try:
                return load(path)
            except OSError as exc:
                if os.sep not in path:
                    problems.append(f"the loader finds no {self.soname}")
                elif os.path.exists(path):
                    problems.append(f"{path} does not load ({exc})")
                else:
                    problems.append(f"{path} does not exist")
        if explicit:
            hint = ""
        elif os.environ.get(self.env_library):
            hint = f" (from ${self.env_library})"
        else:
            unset = "" if os.environ.get(self.env_home) else f"${self.env_home} is unset and "
            problems = [unset + "; ".join(problems)]
            hint = f"; set ${self.env_home} ({self.home_hint} does) or ${self.env_library}"
        raise BackendUnavailableError(f"{self.soname} not found: {'; '.join(problems)}{hint}",
                                      backend=self.backend)

    def probe_library(self, open_library: Callable[[], L], has_extension: bool) -> tuple[L | None, str | None]:
        """The library a probe goes on to ask for devices, or ``(None, why the backend is unavailable)``.

        At the default location the backend needs both the library and the torch
        extension; with ``env_library`` set (named on purpose) the library alone is enough.
        """
        override = bool(os.environ.get(self.env_library))
        try:
            library = open_library()
        except BackendUnavailableError as exc:
            reason = str(exc).removeprefix(f"{self.backend}: ")
            if not override and not has_extension:
                reason += f"; and {self.extension} is not installed"
            return None, reason
        if not has_extension and not override:
            return None, (f"{self.extension} is not installed (found {library.path}; set "
                          f"${self.env_library}={library.path} to use the VMM hooks without it)")
        return library, None
