"""FlashInfer's vLLM-style all-reduce, cut out of its wheel for a device machine that installs nothing.

    python tests/cuda_scripts/flashinfer_site.py WHEEL TVM_FFI_WHEEL --out .whl-fi

FlashInfer's wheel (flashinfer-python, about 100 MB) and what its package imports at start exceed what travels to
a lent device machine. This keeps what ``flashinfer.comm.vllm_*`` needs, unchanged: the Python of its package root,
of ``flashinfer.jit`` (the JIT that builds the module with nvcc on the device) and of ``flashinfer.comm.vllm_ar``
and ``cuda_ipc``, the all-reduce's CUDA source and FlashInfer's headers. Two files are replaced: the package's
``__init__`` (it imports every kernel family) by one that sets the version, and ``flashinfer.comm``'s by one that
imports the all-reduce and the IPC buffer helper. The kernel, its binding and its registration are FlashInfer's.
The apache-tvm-ffi wheel (cp312, what the JIT compiles against) is copied beside ``site/``; the device command
installs it (``tests/cuda_scripts/flashinfer_allreduce.py`` says how).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path

ROOT_INIT = '''"""FlashInfer, cut to its vLLM-style all-reduce (tests/cuda_scripts/flashinfer_site.py)."""

from .version import __version__ as __version__
'''

COMM_INIT = '''"""flashinfer.comm, cut to the vLLM-style all-reduce and the IPC buffer helper."""

from ..jit.comm import gen_vllm_comm_module as gen_vllm_comm_module
from .cuda_ipc import create_shared_buffer as create_shared_buffer
from .cuda_ipc import free_shared_buffer as free_shared_buffer
from .vllm_ar import all_reduce as vllm_all_reduce
from .vllm_ar import dispose as vllm_dispose
from .vllm_ar import get_graph_buffer_ipc_meta as vllm_get_graph_buffer_ipc_meta
from .vllm_ar import init_custom_ar as vllm_init_custom_ar
from .vllm_ar import meta_size as vllm_meta_size
from .vllm_ar import register_buffer as vllm_register_buffer
from .vllm_ar import register_graph_buffers as vllm_register_graph_buffers
'''

KEEP_DATA = ("flashinfer/data/csrc/vllm_custom_all_reduce.cu", "flashinfer/data/csrc/tvm_ffi_utils.h")


def kept(name: str) -> bool:
    """Whether the wheel's member ``name`` goes into the site."""
    parts = name.split("/")
    if parts[0].endswith(".dist-info"):
        return True
    if parts[0] != "flashinfer":
        return False
    if len(parts) == 2:
        return name.endswith(".py")
    if parts[1] == "jit":
        return name.endswith(".py")
    if parts[1] == "comm":
        return parts[2] in ("__init__.py", "vllm_ar.py", "cuda_ipc.py")
    return name in KEEP_DATA or name.startswith("flashinfer/data/include/")


def build(wheel: Path, tvm_ffi: Path, out: Path) -> int:
    """Write ``out/site`` and copy ``tvm_ffi`` into ``out``; the bytes written."""
    site = out / "site"
    shutil.rmtree(out, ignore_errors=True)
    site.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if kept(name) and not name.endswith("/"):
                zf.extract(name, site)
    (site / "flashinfer" / "__init__.py").write_text(ROOT_INIT)
    (site / "flashinfer" / "comm" / "__init__.py").write_text(COMM_INIT)
    shutil.copy(tvm_ffi, out / tvm_ffi.name)
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("wheel", type=Path, help="flashinfer_python-*.whl (pip download --no-deps flashinfer-python)")
    parser.add_argument("tvm_ffi", type=Path, help="apache_tvm_ffi-*-cp312-*.whl (pip download --no-deps "
                                                   "--python-version 3.12 --only-binary=:all: apache-tvm-ffi)")
    parser.add_argument("--out", type=Path, default=Path(".whl-fi"))
    args = parser.parse_args()
    written = build(args.wheel, args.tvm_ffi, args.out)
    print(f"{args.out}: {written / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
