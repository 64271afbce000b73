"""The device addresses a CUDA graph uses, read from the graph while it is still being captured.

torch instantiates a captured ``cudaGraph_t`` and drops it in ``capture_end``,
so the graph is read just before that: ``cuStreamGetCaptureInfo`` on the
capture stream gives the graph under construction, and every node of it is
read by type:

* kernel nodes (``cuGraphKernelNodeGetParams``): the argument values, through
  ``kernelParams`` laid out by ``cuFuncGetParamInfo`` (``cuKernelGetParamInfo``
  for library kernels), and the packed argument buffer of ``extra``
  (``CU_LAUNCH_PARAM_BUFFER_POINTER``/``_SIZE``, as cuBLAS launches GEMMs).
  Every aligned 8-byte word of the arguments that could be a device address
  is reported, so that pointers inside structures and tensor-map (TMA)
  descriptors count; the size behind such a word is unknown (``nbytes=1``);
* memcpy nodes (source and destination in device memory) and memset nodes
  (destination), with their extents;
* graph-memory allocation and free nodes (their pointer);
* child graphs, read recursively.

Nodes that touch no device memory (empty, event, host-function and semaphore
nodes) are read as such. A node that cannot be read (an argument layout the
driver does not give, a conditional or batched memory-op node) is counted in
``missed`` and logged at DEBUG.

The argument layout of each kernel is asked once and cached: the same kernels
repeat across layers and captures.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hal.backends.cuda.errors import CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS, NAME
from hal.errors import InvalidStateError
from hal.types import GraphAddresses

log = logging.getLogger("hal.cuda")

#: a word of argument memory is a candidate device address inside [LOW, HIGH): above small integers and
#: below the top of a 57-bit user address space; false candidates cost the checker only a lookup
LOW = 1 << 16
HIGH = 1 << 57

#: the markers of a kernel launch's ``extra`` array
PARAM_END, PARAM_BUFFER_POINTER, PARAM_BUFFER_SIZE = 0, 1, 2
MAX_EXTRA_ENTRIES = 32  # an ``extra`` array is a few pairs; stop reading a malformed one here
MAX_PARAMS = 4096  # a kernel's parameter space holds at most 32 KiB
MAX_PARAM_BYTES = 32 << 10
MAX_DEPTH = 16  # child graphs nested deeper are not read

#: the driver calls the walk needs (the first name a cuda-python release has of each)
REQUIRED = (("cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v2"),
            ("cuGraphGetNodes",), ("cuGraphNodeGetType",),
            ("cuGraphKernelNodeGetParams", "cuGraphKernelNodeGetParams_v2"), ("cuFuncGetParamInfo",),
            ("cuGraphMemcpyNodeGetParams",), ("cuGraphMemsetNodeGetParams",), ("cuGraphChildGraphNodeGetGraph",))
MIN_DRIVER = 12040  # cuFuncGetParamInfo came with CUDA 12.4

# -- reading argument memory (host addresses the driver hands out) -------------------------------


def candidates(buf: bytes | bytearray | memoryview) -> list[int]:
    """The aligned 8-byte little-endian words of ``buf`` that could be device addresses.

    ``buf`` starts at offset 0 of a kernel's parameter space (8-byte aligned);
    a trailing partial word is ignored.
    """
    count = len(buf) // 8
    if not count:
        return []
    return [w for w in struct.unpack_from(f"<{count}Q", buf) if LOW <= w < HIGH]


def read_extra(extra: int) -> bytes | None:
    """The packed argument buffer of a launch's ``extra`` array at host address ``extra``.

    ``extra`` is ``void*[]`` of key/value pairs ended by ``CU_LAUNCH_PARAM_END``:
    ``CU_LAUNCH_PARAM_BUFFER_POINTER`` then the buffer's address,
    ``CU_LAUNCH_PARAM_BUFFER_SIZE`` then the address of its ``size_t`` size.
    None when the array names no buffer with a size, or is not ended within
    :data:`MAX_EXTRA_ENTRIES` pairs.
    """
    if not extra:
        return None
    words = (ctypes.c_void_p * (2 * MAX_EXTRA_ENTRIES)).from_address(extra)
    buffer = size_at = None
    for i in range(0, 2 * MAX_EXTRA_ENTRIES, 2):
        key = words[i] or 0
        if key == PARAM_END:
            break
        value = words[i + 1] or 0
        if key == PARAM_BUFFER_POINTER:
            buffer = value
        elif key == PARAM_BUFFER_SIZE:
            size_at = value
    else:
        return None
    if not buffer or not size_at:
        return None
    size = ctypes.c_size_t.from_address(size_at).value
    if not 0 < size <= MAX_PARAM_BYTES:
        return None
    return ctypes.string_at(buffer, size)


def read_params(kernel_params: int, layout: tuple[tuple[int, int], ...]) -> bytes:
    """A kernel's parameter space, rebuilt from ``kernelParams`` (``void*[]``, one pointer per argument).

    :param layout: ``(offset, size)`` of each argument in the parameter space.
    """
    if not layout:
        return b""
    count = len(layout)
    pointers = (ctypes.c_void_p * count).from_address(kernel_params)
    end = max(offset + size for offset, size in layout)
    first = pointers[0] or 0
    base = first - layout[0][0]
    if first and all((p or 0) == base + offset for p, (offset, _) in zip(pointers, layout, strict=True)):
        return ctypes.string_at(base, end)  # the arguments lie packed as in the parameter space: one read
    space = bytearray(end)
    for p, (offset, size) in zip(pointers, layout, strict=True):
        if p:
            space[offset:offset + size] = ctypes.string_at(p, size)
    return bytes(space)


def extent(width: int, height: int, depth: int, pitch: int, rows_per_slice: int) -> int:
    """Bytes from the first to the last byte a 1-3D copy or set touches."""
    height, depth = max(height, 1), max(depth, 1)
    if height == 1 and depth == 1:
        return width
    return (depth - 1) * pitch * max(rows_per_slice, height) + (height - 1) * pitch + width


# -- the walk ------------------------------------------------------------------------------------


@dataclass
class Walk:
    """What one walk of a graph found."""

    addresses: set[tuple[int, int]] = field(default_factory=set)
    nodes: int = 0
    missed: int = 0
    kernels: int = 0
    kernels_missed: int = 0
    by_type: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def result(self) -> GraphAddresses:
        return GraphAddresses(tuple(sorted(self.addresses)), nodes=self.nodes, missed=self.missed,
                              seconds=self.seconds)

    def summary(self) -> str:
        types = ", ".join(f"{k}={v}" for k, v in sorted(self.by_type.items()))
        return (f"{self.nodes} node(s) ({types}), {self.missed} missed, kernel nodes read "
                f"{self.kernels - self.kernels_missed}/{self.kernels}, {len(self.addresses)} address(es), "
                f"{self.seconds * 1e3:.2f} ms")


class GraphWalker:
    """Reads the addresses of CUDA graphs through cuda-python's driver module."""

    def __init__(self, driver: Any = None) -> None:
        if driver is None:
            from cuda.bindings import driver as bindings

            driver = bindings
        self.d = driver
        self._capture_info = _first(driver, REQUIRED[0])
        self._kernel_params = _first(driver, REQUIRED[3])
        types = driver.CUgraphNodeType
        names = {"KERNEL": self._kernel, "MEMCPY": self._memcpy, "MEMSET": self._memset, "GRAPH": self._child,
                 "MEM_ALLOC": self._mem_alloc, "MEM_FREE": self._mem_free}
        quiet = ("EMPTY", "WAIT_EVENT", "EVENT_RECORD", "HOST", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT")
        self._readers: dict[int, Any] = {}
        self._names: dict[int, str] = {}
        for member in types:
            short = member.name.removeprefix("CU_GRAPH_NODE_TYPE_")
            self._names[int(member)] = short.lower()
            if short in names:
                self._readers[int(member)] = names[short]
            elif short in quiet:
                self._readers[int(member)] = _nothing
        self._layouts: dict[tuple[int, int], tuple[tuple[int, int], ...] | None] = {}  # by (func, kern)
        self._lock = threading.Lock()
        self._device_memory = {int(m) for m in driver.CUmemorytype
                               if m.name in ("CU_MEMORYTYPE_DEVICE", "CU_MEMORYTYPE_UNIFIED")}
        active = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        self._active = int(active)

    # -- entry points ---------------------------------------------------------------------------

    def capture_addresses(self, stream: int) -> Walk:
        """Walk the graph being captured on ``stream`` (a ``CUstream`` handle)."""
        start = time.perf_counter()
        graph = self.capturing_graph(stream)
        walk = Walk()
        self.walk(graph, walk)
        walk.seconds = time.perf_counter() - start
        log.debug("cuda: graph under capture read: %s", walk.summary())
        return walk

    def capturing_graph(self, stream: int) -> Any:
        """The graph under construction on ``stream``.

        :raises InvalidStateError: the stream is not capturing.
        """
        result = self._capture_info(stream)
        code = int(result[0])
        if code != CUDA_SUCCESS:
            from hal.backends.cuda.errors import error_for

            raise error_for(code, "cuStreamGetCaptureInfo", "graph_addresses", f"stream={stream:#x}")
        status = next((v for v in result[1:] if isinstance(v, self.d.CUstreamCaptureStatus)), None)
        graph = next((v for v in result[1:] if isinstance(v, self.d.CUgraph)), None)
        if status is None or int(status) != self._active or graph is None or not int(graph):
            raise InvalidStateError(f"stream {stream:#x} is not capturing", backend=NAME, call="graph_addresses")
        return graph

    def walk(self, graph: Any, walk: Walk, depth: int = 0) -> None:
        """Add what the nodes of ``graph`` (and its child graphs) use to ``walk``."""
        d = self.d
        err, _, count = d.cuGraphGetNodes(graph, 0)
        _check(err, "cuGraphGetNodes")
        if not count:
            return
        err, nodes, count = d.cuGraphGetNodes(graph, count)
        _check(err, "cuGraphGetNodes")
        for node in nodes[:count]:
            walk.nodes += 1
            err, kind = d.cuGraphNodeGetType(node)
            kind = int(kind) if int(err) == CUDA_SUCCESS else -1
            name = self._names.get(kind, f"type {kind}")
            walk.by_type[name] += 1
            reader = self._readers.get(kind)
            try:
                ok = reader is not None and reader(node, walk, depth)
            except Exception as exc:  # noqa: BLE001 - one unreadable node is counted, not fatal to the walk
                log.debug("cuda: %s node %#x not read: %s: %s", name, int(node), type(exc).__name__, exc)
                ok = False
            else:
                if not ok:
                    log.debug("cuda: %s node %#x not read", name, int(node))
            if not ok:
                walk.missed += 1
                if name == "kernel":
                    walk.kernels_missed += 1

    # -- node readers: True when the node was read --------------------------------------------

    def _kernel(self, node: Any, walk: Walk, depth: int) -> bool:
        walk.kernels += 1
        err, params = self._kernel_params(node)
        _check(err, "cuGraphKernelNodeGetParams")
        kernel_params, extra = address(params.kernelParams), address(params.extra)
        found = walk.addresses
        read = False
        if extra:
            buf = read_extra(extra)
            if buf is not None:
                found.update((w, 1) for w in candidates(buf))
                read = True
        if kernel_params:
            layout = self.layout(params)
            if layout is None:
                return read
            found.update((w, 1) for w in candidates(read_params(kernel_params, layout)))
            return True
        if read:
            return True
        return self.layout(params) == ()  # no arguments given: read only when the kernel takes none

    def _memcpy(self, node: Any, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemcpyNodeGetParams(node)
        _check(err, "cuGraphMemcpyNodeGetParams")
        for side in ("src", "dst"):
            if int(getattr(p, f"{side}MemoryType")) not in self._device_memory:
                continue  # host memory or a CUDA array: nothing of a pool's
            pitch = int(getattr(p, f"{side}Pitch"))
            start = (int(getattr(p, f"{side}Device")) + int(getattr(p, f"{side}XInBytes"))
                     + int(getattr(p, f"{side}Y")) * pitch
                     + int(getattr(p, f"{side}Z")) * pitch * int(getattr(p, f"{side}Height")))
            size = extent(int(p.WidthInBytes), int(p.Height), int(p.Depth), pitch, int(getattr(p, f"{side}Height")))
            if start and size:
                walk.addresses.add((start, size))
        return True

    def _memset(self, node: Any, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemsetNodeGetParams(node)
        _check(err, "cuGraphMemsetNodeGetParams")
        dst = int(p.dst)
        size = extent(int(p.width) * int(p.elementSize), int(p.height), 1, int(p.pitch), 1)
        if dst and size:
            walk.addresses.add((dst, size))
        return True

    def _child(self, node: Any, walk: Walk, depth: int) -> bool:
        if depth >= MAX_DEPTH:
            return False
        err, child = self.d.cuGraphChildGraphNodeGetGraph(node)
        _check(err, "cuGraphChildGraphNodeGetGraph")
        self.walk(child, walk, depth + 1)
        return True

    def _mem_alloc(self, node: Any, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemAllocNodeGetParams(node)
        _check(err, "cuGraphMemAllocNodeGetParams")
        walk.addresses.add((int(p.dptr), max(int(p.bytesize), 1)))
        return True

    def _mem_free(self, node: Any, walk: Walk, depth: int) -> bool:
        err, dptr = self.d.cuGraphMemFreeNodeGetParams(node)
        _check(err, "cuGraphMemFreeNodeGetParams")
        walk.addresses.add((int(dptr), 1))
        return True

    # -- argument layouts -----------------------------------------------------------------------

    def layout(self, params: Any) -> tuple[tuple[int, int], ...] | None:
        """``(offset, size)`` of each argument of the node's kernel; None when the driver does not say.

        The node names a ``CUfunction`` (``func``) or a context-free ``CUkernel`` (``kern``, used when
        ``func`` is NULL); a ``CUkernel`` may also come cast to a ``CUfunction``, so a function the
        driver does not take is asked again as a kernel.
        """
        func, kern = address(params.func), address(getattr(params, "kern", None))
        key = (func, kern)
        with self._lock:
            if key in self._layouts:
                return self._layouts[key]
        asks: list[tuple[Any, Any]] = []
        if func:
            asks.append((self.d.cuFuncGetParamInfo, params.func))
        by_kernel = getattr(self.d, "cuKernelGetParamInfo", None)
        if by_kernel is not None:
            if func:
                asks.append((by_kernel, self.d.CUkernel(func)))
            if kern:
                asks.append((by_kernel, params.kern))
        found = None
        for call, handle in asks:
            found = _ask_layout(call, handle)
            if found is not None:
                break
        with self._lock:
            self._layouts[key] = found
        return found


def _ask_layout(call: Any, handle: Any) -> tuple[tuple[int, int], ...] | None:
    """The layout ``call`` (``cuFuncGetParamInfo`` or ``cuKernelGetParamInfo``) gives; None when it refuses."""
    layout: list[tuple[int, int]] = []
    for index in range(MAX_PARAMS):
        err, offset, size = call(handle, index)
        code = int(err)
        if code == CUDA_SUCCESS:
            layout.append((int(offset), int(size)))
            continue
        if code == CUDA_ERROR_INVALID_VALUE:  # past the last argument
            return tuple(layout)
        log.debug("cuda: no argument layout for a kernel (%s at index %d)", err, index)
        return None
    return None


def address(value: Any) -> int:
    """The integer behind a pointer or handle as cuda-python hands it out (an int, or an object
    that converts to one); 0 for None."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    return int(value)


def _first(driver: Any, names: tuple[str, ...]) -> Any:
    """The first of ``names`` that ``driver`` has."""
    for name in names:
        fn = getattr(driver, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"cuda-python lacks {names[0]}")


def _nothing(node: Any, walk: Walk, depth: int) -> bool:
    return True


def _check(err: Any, native_call: str) -> None:
    code = int(err)
    if code != CUDA_SUCCESS:
        from hal.backends.cuda.errors import error_for

        raise error_for(code, native_call, "graph_addresses")


# -- availability ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why graphs cannot be read here (None when they can); logged once."""
    reason = _find_problem()
    if reason is not None:
        log.info("cuda: no 'graph_addresses': %s", reason)
    return reason


def _find_problem() -> str | None:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return f"cuda-python does not import ({exc})"
    missing = [names[0] for names in REQUIRED if not any(hasattr(driver, name) for name in names)]
    if missing:
        return f"this cuda-python lacks {', '.join(missing)}"
    err, version = driver.cuDriverGetVersion()
    if int(err) != CUDA_SUCCESS:
        return f"cuDriverGetVersion failed ({err})"
    if int(version) < MIN_DRIVER:
        major, minor = divmod(int(version), 1000)
        return (f"the driver supports CUDA {major}.{minor // 10}; reading kernel arguments "
                "(cuFuncGetParamInfo) needs CUDA 12.4")
    return None


_walker: GraphWalker | None = None
_walker_lock = threading.Lock()


def walker() -> GraphWalker:
    """The process's one walker (its argument layouts are shared by every device and capture)."""
    global _walker
    with _walker_lock:
        if _walker is None:
            _walker = GraphWalker()
        return _walker


def addresses_of(stream: int) -> GraphAddresses:
    """What the graph being captured on ``stream`` (a ``CUstream`` handle) uses."""
    return walker().capture_addresses(stream).result()

