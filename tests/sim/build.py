"""Compile the driver simulators with gcc, once per source (cached by a hash of source and flags).

The output lies where the vendors' installers put the real library, so the
``$ASCEND_HOME_PATH`` / ``$NEUWARE_HOME`` lookups can be tested too::

    <cache>/<hash>/ascend/lib64/libascendcl.so
    <cache>/<hash>/neuware/lib64/libcndrv.so
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: backend name -> (source, home directory name, library path under the home)
SIMULATORS = {
    "ascend": ("acl_sim.c", "ascend", "lib64/libascendcl.so"),
    "mlu": ("cndrv_sim.c", "neuware", "lib64/libcndrv.so"),
}
CFLAGS = ["-std=gnu11", "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
          "-pthread"]


def compiler_reason() -> str | None:
    """Why the simulators cannot be built here, or None."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return "no C compiler (gcc) on PATH to build the driver simulators"
    return None


def _cache_root() -> Path:
    return Path(os.environ.get("HAL_SIM_CACHE") or Path(tempfile.gettempdir()) / f"hal-sim-{os.getuid()}")


def home(name: str, *, set_access: bool = True) -> Path:
    """The simulated install directory (``$ASCEND_HOME_PATH`` / ``$NEUWARE_HOME``), built if needed."""
    source, home_dir, _ = SIMULATORS[name]
    defines = [] if set_access else ["-DACL_SIM_NO_SET_ACCESS"]
    text = (HERE / source).read_bytes() + " ".join(CFLAGS + defines).encode()
    root = _cache_root() / hashlib.sha256(text).hexdigest()[:16] / home_dir
    library(name, root, defines)
    return root


def library(name: str, root: Path, defines: list[str]) -> Path:
    """Compile ``name``'s simulator into ``root`` unless it is there already."""
    source, _, rel = SIMULATORS[name]
    out = root / rel
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes build it once
        if not out.exists():
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            cmd = [os.environ.get("CC", "gcc"), *CFLAGS, *defines, "-o", str(tmp), str(HERE / source)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"building the {name} simulator failed:\n{' '.join(cmd)}\n{proc.stderr}")
            os.replace(tmp, out)
    return out


def built(name: str, *, set_access: bool = True) -> Path:
    """The compiled simulator library of backend ``name``."""
    return home(name, set_access=set_access) / SIMULATORS[name][2]
