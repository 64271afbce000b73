"""``ascend``: placeholder until the adapter lands: a real, cheap probe and nothing else."""

from __future__ import annotations

import ctypes
import importlib.util
import os

from hal.backends.cuda.probe import CudaBackend as _Stub


class AscendBackend(_Stub):
    """Not implemented yet: every call raises BackendUnavailableError."""

    @classmethod
    def probe(cls) -> str | None:
        home = os.environ.get("ASCEND_HOME_PATH")
        path = os.path.join(home, "lib64", "libascendcl.so") if home else "libascendcl.so"
        try:
            ctypes.CDLL(path)
        except OSError:
            return f"libascendcl.so was not found (looked for {path}; set $ASCEND_HOME_PATH)"
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        return None
