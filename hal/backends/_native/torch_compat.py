"""Every private torch (and torch_npu / torch_mlu) API hal uses, in one place.

Each :class:`PrivateApi` says what hal uses it for, where it lives per device
type (``cuda``, ``npu``, ``mlu``), the versions it was checked on and what
happens without it. Look one up with :func:`lookup` (``None`` when missing) or
:func:`require` (:class:`hal.UnsupportedError` naming the API and the installed
versions when missing): never with a bare ``getattr`` that ends in an
``AttributeError``.

Checked on torch 2.13.0+cpu (this project's CI) and torch 2.11.0+cu130 (the
GPU machine); ``pyproject.toml`` declares torch >= 2.8. A CPU build of torch
defines the CUDA pool functions as dummies that raise when called: they count
as missing here. The torch_npu / torch_mlu names were read from their sources
and run only against the stubs in ``tests/sim``.

Two structures that torch does not document are read here too: the memory
snapshot (:func:`memory_snapshot`, :func:`active_blocks`) and the class
attribute ``torch.<device>.graph.default_capture_stream``
(:func:`default_capture_stream`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hal.errors import UnsupportedError

#: the oldest torch whose graph pools route segment allocations to a MemPool's custom allocator
MIN_TORCH_FOR_CUSTOM_POOL = (2, 8)

_CPU, _GPU = "torch 2.13.0+cpu", "torch 2.11.0+cu130"
_NO_CUSTOM_POOL = 'no "custom_pool" capability: create_pool with callbacks raises UnsupportedError'


@dataclass(frozen=True)
class PrivateApi:
    """One private API and its home per device type."""

    #: what hal uses it for
    purpose: str
    #: device type -> dotted paths from the module's name; the first one present wins
    paths: Mapping[str, tuple[str, ...]]
    #: the versions it was checked on
    checked: str
    #: what hal does when it is missing
    missing: str

    def name(self, device_type: str) -> str:
        """The preferred path of this API for ``device_type`` (for messages)."""
        paths = self.paths.get(device_type, ())
        return paths[0] if paths else f"<no {self.purpose} for {device_type}>"


#: device type -> (module, the module's C extension): where each framework keeps its private bindings
_HOMES = {"cuda": ("torch", "_C"), "npu": ("torch_npu", "_C"), "mlu": ("torch_mlu", "_MLUC")}


def _bindings(*names: str) -> dict[str, tuple[str, ...]]:
    """The paths of the C binding ``_<device>_<name>`` of each framework, for each of ``names`` in turn."""
    return {dev: tuple(f"{module}.{ext}._{dev}_{name}" for name in names) for dev, (module, ext) in _HOMES.items()}


def _namespace(name: str, memory_too: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """The paths of ``<module>.<device>.<name>``; for the device types in ``memory_too`` also
    ``<module>.<device>.memory.<name>`` (where some releases keep it)."""
    paths: dict[str, tuple[str, ...]] = {dev: (f"{module}.{dev}.{name}",) for dev, (module, _) in _HOMES.items()}
    for dev in memory_too:
        paths[dev] += (f"{_HOMES[dev][0]}.{dev}.memory.{name}",)
    return paths


CUSTOM_ALLOCATOR = PrivateApi(
    purpose="wrap two C function pointers (alloc, free) as an allocator object for a MemPool",
    paths=_bindings("customAllocator"),
    checked=f"{_GPU}; absent from CPU builds ({_CPU})",
    missing=_NO_CUSTOM_POOL,
)

#: absent from the public torch_mlu branches; torch.mlu.memory.MemPool in torch-mlu >= 1.27
MEM_POOL = PrivateApi(
    purpose="a pool over a custom allocator: MemPool(allocator), its .id, use_count()",
    paths=_namespace("MemPool", memory_too=("npu", "mlu")),
    checked=f"{_GPU}; {_CPU} (unusable there: its base class is a dummy)",
    missing=_NO_CUSTOM_POOL,
)

#: torch_npu renamed the first in 2.13 (the second is the older name)
END_ALLOCATE_TO_POOL = PrivateApi(
    purpose="stop routing a stream's allocations to a pool (undo of a capture that failed half-way)",
    paths=_bindings("endAllocateToPool", "endAllocateCurrentStreamToPool"),
    checked=f"{_GPU}; a dummy in {_CPU}",
    missing="the failed capture is not undone and a warning says so (an error would hide the capture's own)",
)

RELEASE_POOL = PrivateApi(
    purpose="drop the reference on a pool that a failed capture took",
    paths=_bindings("releasePool"),
    checked=f"{_GPU}; a dummy in {_CPU}",
    missing=END_ALLOCATE_TO_POOL.missing,
)

MEMORY_SNAPSHOT = PrivateApi(
    purpose="the caching allocator's segments and blocks (read by pool_active_blocks)",
    paths=_namespace("memory_snapshot"),
    checked=f"{_GPU} (keywords mempool_id, include_traces); {_CPU} has the function",
    missing="pool_active_blocks reports no blocks and logs why once per glue",
)

USE_MEM_POOL = PrivateApi(
    purpose="route the calling thread's allocations to a MemPool inside a block (the use_pool hook)",
    paths=_namespace("use_mem_pool", memory_too=("npu", "mlu")),
    checked=f"{_GPU}; torch_npu and torch_mlu read from their sources only",
    missing='no "use_pool" capability: use_pool raises UnsupportedError',
)


def _is_dummy(obj: Any) -> bool:
    """A CPU build's stand-in for a CUDA function (a class from ``torch._utils`` that raises when called)."""
    return isinstance(obj, type) and obj.__module__ == "torch._utils"


def _resolve(path: str, modules: Mapping[str, Any]) -> Any | None:
    root, *attrs = path.split(".")
    obj = modules.get(root)
    for attr in attrs:
        if obj is None:
            return None
        obj = getattr(obj, attr, None)
    return None if obj is None or _is_dummy(obj) else obj


def lookup(api: PrivateApi, device_type: str, modules: Mapping[str, Any]) -> Any | None:
    """The object ``api`` names for ``device_type``, or None when this install lacks it.

    :param modules: module name -> module, e.g. ``{"torch": torch, "torch_npu": torch_npu}``.
    """
    for path in api.paths.get(device_type, ()):
        found = _resolve(path, modules)
        if found is not None:
            return found
    return None


def versions(modules: Mapping[str, Any]) -> str:
    """``"torch 2.13.0+cpu, torch_npu 2.5.1"``: the installed versions, for messages."""
    seen: dict[int, str] = {}
    for name, module in modules.items():
        if module is not None and id(module) not in seen:
            seen[id(module)] = f"{name} {getattr(module, '__version__', '(version unknown)')}"
    return ", ".join(seen.values())


def require(api: PrivateApi, device_type: str, modules: Mapping[str, Any], *, backend: str, call: str) -> Any:
    """Like :func:`lookup`, but a missing API raises :class:`hal.UnsupportedError` naming it and the versions."""
    found = lookup(api, device_type, modules)
    if found is None:
        raise UnsupportedError(f"{api.name(device_type)} is missing in {versions(modules)} (checked on "
                               f"{api.checked}): {api.missing}", backend=backend, call=call)
    return found


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"2.5.1.post17+cpu"`` -> ``(2, 5, 1)``, ``"rc"`` -> ``()``."""
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def alloc_conf_setting(variables: Iterable[str], key: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``"VAR=...key:True..."`` when the first of ``variables`` that is set turns option ``key`` on, else None.

    The value is read as torch's allocator config parser reads it: comma-separated
    ``key:value`` pairs, where only ``True`` switches an option on.
    """
    env = os.environ if environ is None else environ
    for var in variables:
        conf = env.get(var)
        if conf is None:
            continue
        for item in conf.split(","):
            name, _, value = item.partition(":")
            if name.strip() == key and value.strip() == "True":
                return f"{var}={conf}"
        return None  # the extension reads the first variable that is set, not the others
    return None


def torch_version(torch: Any) -> tuple[int, int]:
    """``(major, minor)`` of ``torch.__version__`` (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0)
                    for part in [*torch.__version__.split("."), "0"][:2])
    return major, minor


# -- the memory snapshot -------------------------------------------------------------------


def memory_snapshot(snapshot: Callable[..., Iterable[dict]], pool_id: tuple) -> list[dict]:
    """Segments from ``torch.<device>.memory_snapshot``, asking for ``pool_id``'s alone where it can.

    Newer builds take ``mempool_id`` and ``include_traces`` (traces are slow
    and unused here); older ones neither, and return every segment.

    torch's C entry behind it (``_cuda_memorySnapshot`` up to at least 2.11)
    drops one reference to each element of the pool id it is given, which it
    only borrowed (pytorch/pytorch#196366). Pool ids above 256 are heap
    integers, so after a few snapshots the caller's pool id is freed while
    still in use and the process crashes later, far from the cause. The pool
    id is therefore passed as private copies, and whatever references the
    call took from them are given back before they can be freed.
    """
    ids = tuple(_private_copy(part) for part in pool_id)
    spare = list(ids) * 3  # references the call may take (one per attempt) without freeing the copies
    before = _refcounts(ids)
    try:
        for kwargs in ({"mempool_id": ids, "include_traces": False}, {"mempool_id": ids}):
            try:
                return list(snapshot(**kwargs))
            except TypeError:
                continue
        return list(snapshot())
    finally:
        _give_back_references(ids, before)
        del spare


def _private_copy(part: Any) -> Any:
    """A new integer equal to ``part``, referenced by the caller alone (other values as they are)."""
    if isinstance(part, int) and not isinstance(part, bool):
        return int(str(int(part)))
    return part


def _refcounts(values: tuple) -> list[int]:
    """Reference counts of ``values``' elements, each read the same way (no temporaries)."""
    return [sys.getrefcount(values[i]) for i in range(len(values))]


def _give_back_references(values: tuple, before: list[int]) -> None:
    """Add back the references a call took from ``values``' elements without owning them."""
    after = _refcounts(values)
    for i in range(len(values)):
        for _ in range(before[i] - after[i]):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(values[i]))


def active_blocks(segments: Iterable[dict], pool_id: tuple | None = None,
                  device: int | None = None, addresses: Container[int] | None = None) -> list[tuple[int, int]]:
    """``(address, bytes)`` of every allocated block in snapshot ``segments``, sorted.

    A segment has ``address``, ``segment_pool_id``, ``device`` and ``blocks``;
    a block has ``size``, ``state`` and, in some builds, its own ``address``
    (otherwise it starts where the previous block ended). Some builds (torch_npu
    2.5.1) leave ``segment_pool_id`` out.

    :param pool_id: keep only the segments of this pool.
    :param device: keep only the segments of this device (segments without one are kept).
    :param addresses: where a segment has no ``segment_pool_id``, it belongs to ``pool_id`` when its
        address is one of these (the segments the pool's allocator handed out); without them such a
        segment belongs to no pool.
    """
    found = []
    for segment in segments:
        if pool_id is not None and not _in_pool(segment, tuple(pool_id), addresses):
            continue
        if device is not None and segment.get("device", device) != device:
            continue
        at = int(segment.get("address", 0))
        for block in segment.get("blocks", ()):
            address, size = int(block.get("address", at)), int(block["size"])
            if block.get("state") == "active_allocated":
                found.append((address, size))
            at = address + size
    return sorted(found)


def _in_pool(segment: dict, pool_id: tuple, addresses: Container[int] | None) -> bool:
    if "segment_pool_id" in segment:
        return tuple(segment["segment_pool_id"]) == pool_id
    return addresses is not None and int(segment.get("address", -1)) in addresses


# -- the graph context manager's side stream -----------------------------------------------------


def default_capture_stream(graph_cm: Any, make_stream: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """The stream ``torch.<device>.graph`` captures on when given none.

    It is the class attribute ``default_capture_stream``, which torch fills
    lazily with a new stream on first use; here it is filled the same way,
    with ``make_stream()``. Where ``graph`` is not a class (some extensions),
    captures run on the current stream: ``fallback()``.
    """
    if getattr(graph_cm, "default_capture_stream", None) is None:
        try:
            graph_cm.default_capture_stream = make_stream()
        except (AttributeError, TypeError):
            return fallback()
    return graph_cm.default_capture_stream
