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

import bisect
import ctypes
import functools
import logging
import struct
import sys
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
    """The distinct aligned 8-byte little-endian words of ``buf`` that could be device addresses, sorted.

    ``buf`` starts at offset 0 of a kernel's parameter space (8-byte aligned),
    or is several such spaces joined, each cut to whole words (:func:`whole_words`);
    a trailing partial word is ignored. (Sorting and bisecting keep the
    per-word work in C: one walk joins thousands of argument blocks.)
    """
    count = len(buf) // 8
    if not count:
        return []
    words = sorted(set(memoryview(buf)[:count * 8].cast("B").cast("Q"))) if _LITTLE else sorted(
        set(struct.unpack_from(f"<{count}Q", buf)))
    return words[bisect.bisect_left(words, LOW):bisect.bisect_left(words, HIGH)]


def whole_words(buf: bytes) -> bytes:
    """``buf`` without a trailing partial word (so that argument blocks can be joined word-aligned)."""
    extra = len(buf) & 7
    return buf[:-extra] if extra else buf


_LITTLE = sys.byteorder == "little"


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
    return Layout(layout).read(kernel_params)


def extent(width: int, height: int, depth: int, pitch: int, rows_per_slice: int) -> int:
    """Bytes from the first to the last byte a 1-3D copy or set touches."""
    height, depth = max(height, 1), max(depth, 1)
    if height == 1 and depth == 1:
        return width
    return (depth - 1) * pitch * max(rows_per_slice, height) + (height - 1) * pitch + width


# -- the driver calls made once per node -----------------------------------------------------------


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``: what ``cuGraphKernelNodeGetParams_v2`` fills in."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
                ("_room", ctypes.c_byte * 128)]  # slack, should a later driver write a longer structure


class Bindings:
    """The per-node calls through cuda-python (one Python object per handle and structure)."""

    def __init__(self, driver: Any) -> None:
        self.d = driver
        self._kernel_params = _first(driver, REQUIRED[3])

    def nodes(self, graph: int) -> list[int]:
        d = self.d
        handle = d.CUgraph(graph)
        err, _, count = d.cuGraphGetNodes(handle, 0)
        _check(err, "cuGraphGetNodes")
        if not count:
            return []
        err, nodes, count = d.cuGraphGetNodes(handle, count)
        _check(err, "cuGraphGetNodes")
        return [int(n) for n in nodes[:count]]

    def node_type(self, node: int) -> int:
        err, kind = self.d.cuGraphNodeGetType(self.d.CUgraphNode(node))
        return int(kind) if int(err) == CUDA_SUCCESS else -1

    def kernel(self, node: int) -> tuple[int, int, int, int]:
        """``(func, kern, kernelParams, extra)`` of a kernel node."""
        err, p = self._kernel_params(self.d.CUgraphNode(node))
        _check(err, "cuGraphKernelNodeGetParams")
        return (address(p.func), address(getattr(p, "kern", None)), address(p.kernelParams), address(p.extra))



class Libcuda(Bindings):
    """The per-node calls straight into libcuda through ctypes: a few times cheaper than cuda-python's
    objects, which matters at hundreds of nodes per capture. The rarer node kinds still go through
    cuda-python."""

    SYMBOLS = ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams_v2")

    def __init__(self, driver: Any, lib: ctypes.CDLL) -> None:
        super().__init__(driver)
        vp, sp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
        self._get_nodes = _bind(lib, "cuGraphGetNodes", vp, vp, sp)
        self._get_type = _bind(lib, "cuGraphNodeGetType", vp, ctypes.POINTER(ctypes.c_int))
        self._get_params = _bind(lib, "cuGraphKernelNodeGetParams_v2", vp, ctypes.POINTER(KernelNodeParams))
        self._local = threading.local()  # per thread: the structures the driver fills in

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        _check(self._get_nodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
        if not count.value:
            return []
        handles = (ctypes.c_void_p * count.value)()
        _check(self._get_nodes(graph, handles, ctypes.byref(count)), "cuGraphGetNodes")
        return [h or 0 for h in handles[:count.value]]

    def _scratch(self) -> tuple[ctypes.c_int, KernelNodeParams]:
        local = self._local
        if not hasattr(local, "kind"):
            local.kind, local.params = ctypes.c_int(), KernelNodeParams()
        return local.kind, local.params

    def node_type(self, node: int) -> int:
        kind, _ = self._scratch()
        return kind.value if self._get_type(node, ctypes.byref(kind)) == CUDA_SUCCESS else -1

    def kernel(self, node: int) -> tuple[int, int, int, int]:
        _, p = self._scratch()
        _check(self._get_params(node, ctypes.byref(p)), "cuGraphKernelNodeGetParams_v2")
        return p.func or 0, p.kern or 0, p.kernelParams or 0, p.extra or 0


def _bind(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def native_calls(driver: Any) -> Bindings:
    """:class:`Libcuda` where the driver library exports its symbols, else :class:`Bindings`."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return Libcuda(driver, lib)
    except (OSError, AttributeError) as exc:
        log.debug("cuda: reading graph nodes through cuda-python objects (%s)", exc)
        return Bindings(driver)


# -- the walk ------------------------------------------------------------------------------------


@dataclass
class Walk:
    """What one walk of a graph found: candidate pointers (``words``) and spans of known size."""

    words: set[int] = field(default_factory=set)
    spans: set[tuple[int, int]] = field(default_factory=set)
    nodes: int = 0
    missed: int = 0
    kernels: int = 0
    kernels_missed: int = 0
    by_type: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def addresses(self) -> set[tuple[int, int]]:
        return self.spans | {(w, 1) for w in self.words}

    def result(self) -> GraphAddresses:
        return GraphAddresses(tuple(sorted(self.addresses)), nodes=self.nodes, missed=self.missed,
                              seconds=self.seconds)

    def summary(self) -> str:
        types = ", ".join(f"{k}={v}" for k, v in sorted(self.by_type.items()))
        return (f"{self.nodes} node(s) ({types}), {self.missed} missed, kernel nodes read "
                f"{self.kernels - self.kernels_missed}/{self.kernels}, {len(self.words)} pointer word(s) and "
                f"{len(self.spans)} span(s), {self.seconds * 1e3:.2f} ms")


class GraphWalker:
    """Reads the addresses of CUDA graphs.

    :param driver: ``cuda.bindings.driver`` (or a stand-in with its names).
    :param calls: the per-node calls; by default straight into libcuda where it can be loaded.
    """

    def __init__(self, driver: Any = None, calls: Bindings | None = None) -> None:
        if driver is None:
            from cuda.bindings import driver as bindings

            driver = bindings
        self.d = driver
        self.calls = calls if calls is not None else Bindings(driver)
        self._capture_info = _first(driver, REQUIRED[0])
        types = driver.CUgraphNodeType
        names = {"MEMCPY": self._memcpy, "MEMSET": self._memset, "GRAPH": self._child,
                 "MEM_ALLOC": self._mem_alloc, "MEM_FREE": self._mem_free}
        quiet = ("EMPTY", "WAIT_EVENT", "EVENT_RECORD", "HOST", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT")
        self._readers: dict[int, Any] = {}
        self._names: dict[int, str] = {}
        self._kernel_type = int(types.CU_GRAPH_NODE_TYPE_KERNEL)
        for member in types:
            short = member.name.removeprefix("CU_GRAPH_NODE_TYPE_")
            self._names[int(member)] = short.lower()
            if short in names:
                self._readers[int(member)] = names[short]
            elif short in quiet:
                self._readers[int(member)] = _nothing
        self._layouts: dict[tuple[int, int], Layout | None] = {}  # by (func, kern)
        self._lock = threading.Lock()
        self._device_memory = {int(m) for m in driver.CUmemorytype
                               if m.name in ("CU_MEMORYTYPE_DEVICE", "CU_MEMORYTYPE_UNIFIED")}
        self._active = int(driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE)

    # -- entry points ---------------------------------------------------------------------------

    def capture_addresses(self, stream: int) -> Walk:
        """Walk the graph being captured on ``stream`` (a ``CUstream`` handle)."""
        start = time.perf_counter()
        graph = self.capturing_graph(stream)
        walk = Walk()
        self.walk(graph, walk)
        walk.seconds = time.perf_counter() - start
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cuda: graph under capture read: %s", walk.summary())
        return walk

    def capturing_graph(self, stream: int) -> int:
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
        return int(graph)

    def walk(self, graph: int, walk: Walk, depth: int = 0) -> None:
        """Add what the nodes of ``graph`` (and its child graphs) use to ``walk``.

        The argument blocks of the kernel nodes are joined and their words read at once.
        """
        calls, kernel_type = self.calls, self._kernel_type
        kinds: Counter[int] = Counter()
        nodes = calls.nodes(graph)
        walk.nodes += len(nodes)
        blocks: list[bytes] = []
        for node in nodes:
            kind = calls.node_type(node)
            try:
                if kind == kernel_type:
                    ok = self._kernel(calls.kernel(node), blocks)
                else:
                    reader = self._readers.get(kind)
                    ok = reader is not None and reader(node, walk, depth)
            except Exception as exc:  # noqa: BLE001 - one unreadable node is counted, not fatal to the walk
                log.debug("cuda: %s node %#x not read: %s: %s", self._names.get(kind, kind), node,
                          type(exc).__name__, exc)
                ok = False
            kinds[kind] += 1
            if not ok:
                log.debug("cuda: %s node %#x not read", self._names.get(kind, kind), node)
                walk.missed += 1
                if kind == kernel_type:
                    walk.kernels_missed += 1
        walk.words.update(candidates(b"".join(blocks)))
        walk.kernels += kinds[kernel_type]
        for kind, count in kinds.items():
            walk.by_type[self._names.get(kind, f"type {kind}")] += count

    # -- node readers: True when the node was read --------------------------------------------

    def _kernel(self, params: tuple[int, int, int, int], blocks: list[bytes]) -> bool:
        """Add the argument block(s) of a kernel node, ``(func, kern, kernelParams, extra)``, to ``blocks``."""
        func, kern, kernel_params, extra = params
        read = False
        if extra:
            buf = read_extra(extra)
            if buf is not None:
                blocks.append(whole_words(buf))
                read = True
        if kernel_params:
            layout = self.layout(func, kern)
            if layout is None:
                return read
            blocks.append(whole_words(layout.read(kernel_params)))
            return True
        if read:
            return True
        layout = self.layout(func, kern)  # no arguments given: read only when the kernel takes none
        return layout is not None and not layout.args

    def _node(self, node: int) -> Any:
        return self.d.CUgraphNode(node)

    def _memcpy(self, node: int, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemcpyNodeGetParams(self._node(node))
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
                walk.spans.add((start, size))
        return True

    def _memset(self, node: int, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemsetNodeGetParams(self._node(node))
        _check(err, "cuGraphMemsetNodeGetParams")
        dst = int(p.dst)
        size = extent(int(p.width) * int(p.elementSize), int(p.height), 1, int(p.pitch), 1)
        if dst and size:
            walk.spans.add((dst, size))
        return True

    def _child(self, node: int, walk: Walk, depth: int) -> bool:
        if depth >= MAX_DEPTH:
            return False
        err, child = self.d.cuGraphChildGraphNodeGetGraph(self._node(node))
        _check(err, "cuGraphChildGraphNodeGetGraph")
        self.walk(int(child), walk, depth + 1)
        return True

    def _mem_alloc(self, node: int, walk: Walk, depth: int) -> bool:
        err, p = self.d.cuGraphMemAllocNodeGetParams(self._node(node))
        _check(err, "cuGraphMemAllocNodeGetParams")
        walk.spans.add((int(p.dptr), max(int(p.bytesize), 1)))
        return True

    def _mem_free(self, node: int, walk: Walk, depth: int) -> bool:
        err, dptr = self.d.cuGraphMemFreeNodeGetParams(self._node(node))
        _check(err, "cuGraphMemFreeNodeGetParams")
        walk.words.add(int(dptr))
        return True

    # -- argument layouts -----------------------------------------------------------------------

    def layout(self, func: int, kern: int) -> Layout | None:
        """The argument layout of a node's kernel; None when the driver does not say.

        The node names a ``CUfunction`` (``func``) or a context-free ``CUkernel`` (``kern``, used when
        ``func`` is NULL); a ``CUkernel`` may also come cast to a ``CUfunction``, so a function the
        driver does not take is asked again as a kernel.
        """
        key = (func, kern)
        found = self._layouts.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found  # type: ignore[return-value]
        asks: list[tuple[Any, Any]] = []
        if func:
            asks.append((self.d.cuFuncGetParamInfo, self.d.CUfunction(func)))
        by_kernel = getattr(self.d, "cuKernelGetParamInfo", None)
        if by_kernel is not None:
            asks.extend((by_kernel, self.d.CUkernel(handle)) for handle in (func, kern) if handle)
        args = None
        for call, handle in asks:
            args = _ask_layout(call, handle)
            if args is not None:
                break
        layout = None if args is None else Layout(args)
        with self._lock:
            self._layouts[key] = layout
        return layout


_UNKNOWN = object()


class Layout:
    """Where a kernel's arguments lie in its parameter space."""

    def __init__(self, args: tuple[tuple[int, int], ...]) -> None:
        self.args = args
        self.offsets = tuple(offset for offset, _ in args)
        self.end = max((offset + size for offset, size in args), default=0)
        self._pointers = ctypes.c_uint64 * len(args)

    def read(self, kernel_params: int) -> bytes:
        """The parameter space, rebuilt from ``kernelParams`` (``void*[]``, one pointer per argument)."""
        if not self.args:
            return b""
        pointers = self._pointers.from_address(kernel_params)
        first, last, middle = pointers[0], pointers[-1], pointers[len(self.args) // 2]
        base = first - self.offsets[0]
        if first and last - base == self.offsets[-1] and middle - base == self.offsets[len(self.args) // 2]:
            # the driver keeps the arguments packed as in the parameter space (first, middle and last
            # pointer agree with the layout): one read
            return ctypes.string_at(base, self.end)
        space = bytearray(self.end)
        for p, (offset, size) in zip(pointers, self.args, strict=True):
            if p:
                space[offset:offset + size] = ctypes.string_at(p, size)
        return bytes(space)


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
            from cuda.bindings import driver

            _walker = GraphWalker(driver, native_calls(driver))
        return _walker


def addresses_of(stream: int) -> GraphAddresses:
    """What the graph being captured on ``stream`` (a ``CUstream`` handle) uses."""
    return walker().capture_addresses(stream).result()

