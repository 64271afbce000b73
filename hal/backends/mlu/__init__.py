"""``mlu``: placeholder until the adapter lands: a real, cheap probe and nothing else."""

from __future__ import annotations

import ctypes
import importlib.util
import os

from hal.backends.cuda.probe import CudaBackend as _Stub


class MluBackend(_Stub):
    """Not implemented yet: every call raises BackendUnavailableError."""

    @classmethod
    def probe(cls) -> str | None:
        home = os.environ.get("NEUWARE_HOME")
        path = os.path.join(home, "lib64", "libcndrv.so") if home else "libcndrv.so"
        try:
            ctypes.CDLL(path)
        except OSError:
            return f"libcndrv.so was not found (looked for {path}; set $NEUWARE_HOME)"
        if importlib.util.find_spec("torch_mlu") is None:
            return "torch_mlu is not installed"
        return None
