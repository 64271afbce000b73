"""CUresult -> hal errors: the one place where the cuda backend judges a native return code."""

from __future__ import annotations

from typing import Any

from hal.backends._native.library import ErrorClasses, native_error
from hal.errors import DeviceOutOfMemoryError, DriverError, InvalidArgumentError

NAME = "cuda"

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910  # cuGraphExecUpdate: the graphs' topologies differ


class CudaDriverError(DriverError):
    """A CUDA driver call failed; ``native_call`` names the driver function."""


class CudaOutOfMemoryError(CudaDriverError, DeviceOutOfMemoryError):
    """CUDA_ERROR_OUT_OF_MEMORY: a :class:`hal.DeviceOutOfMemoryError` that keeps the native code."""


class CudaInvalidValueError(CudaDriverError, InvalidArgumentError):
    """CUDA_ERROR_INVALID_VALUE: a :class:`hal.InvalidArgumentError` that keeps the native code."""


CUDA_ERRORS = ErrorClasses(other=CudaDriverError, out_of_memory=CudaOutOfMemoryError,
                           invalid_argument=CudaInvalidValueError)


def error_name(code: int) -> str | None:
    """``cuGetErrorName`` of ``code`` (None when the driver does not know it)."""
    from cuda.bindings import driver

    try:
        err, name = driver.cuGetErrorName(driver.CUresult(code))
    except (ValueError, RuntimeError):  # not a CUresult this binding knows
        return None
    if int(err) != CUDA_SUCCESS or not name:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def error_text(code: int) -> str:
    """``cuGetErrorString`` of ``code``, or a plain fallback."""
    from cuda.bindings import driver

    try:
        err, text = driver.cuGetErrorString(driver.CUresult(code))
    except (ValueError, RuntimeError):
        return "unknown CUDA error"
    if int(err) != CUDA_SUCCESS or not text:
        return "unknown CUDA error"
    return text.decode() if isinstance(text, bytes) else str(text)


def error_for(code: int, native_call: str, call: str | None, detail: str = "") -> DriverError:
    """The hal error for a failed driver call (``code`` != CUDA_SUCCESS)."""
    return native_error(code, call, native_call, backend=NAME, code_name=error_name(code),
                        out_of_memory=code == CUDA_ERROR_OUT_OF_MEMORY,
                        invalid_argument=code == CUDA_ERROR_INVALID_VALUE, explanation=error_text(code),
                        context=detail, classes=CUDA_ERRORS)


def check(result: Any, native_call: str, call: str | None, detail: str = "") -> Any:
    """Check a cuda-python result tuple ``(CUresult, *values)``; return the values.

    No value -> None, one value -> that value, several -> a tuple.
    """
    code = int(result[0])
    if code != CUDA_SUCCESS:
        raise error_for(code, native_call, call, detail)
    values = result[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
