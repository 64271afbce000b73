"""The fake backend's graph: a recording tape of torch ops.

Capture runs the user's function once under a ``TorchDispatchMode``:

* every result that is not a view of an existing tensor is placed at an
  address handed out by the capture's pool (so intermediates really live in
  the pool's memory, e.g. a virtual space of graphkit's allocator), and the
  op is recorded;
* ops that write into their arguments (in-place, ``out=``) are recorded too;
* views are recorded once, to be rebuilt over the placed memory.

Replay re-runs exactly the recorded ops on the same addresses, never the
Python function, so its cost is proportional to the ops recorded. Ops that
synchronise with the host (``.item()``, ``bool(t)``, printing) raise
:class:`hal.CaptureError`, as they do inside a CUDA graph capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hal.backends.fake.pool import BlockPool
from hal.errors import CaptureError, InvalidStateError

aten = torch.ops.aten

#: ops that need a value on the host (or a data-dependent shape) to proceed
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
_HOST_SYNC_PACKETS = {op.overloadpacket for op in HOST_SYNC_OPS}


@dataclass
class _Slot:
    """A tensor placed in the pool: where it lives and how to view it."""

    ptr: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Op:
    func: Any
    args: Any  # pytree with tensors replaced by _Ref
    kwargs: Any
    fresh: list[tuple[int, int]]  # (output position in the flat result, tensor index)


@dataclass(frozen=True)
class _Ref:
    index: int  # into FakeGraph._tensors


@dataclass
class FakeGraph:
    """A captured tape; build with the backend's ``create_graph``."""

    ops: list[_Op] = field(default_factory=list)
    # each recorded tensor: ("slot", _Slot) | ("view", func, args, kwargs, position) | ("const", tensor)
    entries: list[tuple] = field(default_factory=list)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    own_pool: BlockPool | None = None
    captured: bool = False
    released: bool = False
    on_release: Any = None  # set by a routed capture: told once when the graph is released

    def replay(self) -> None:
        if not self.captured:
            raise InvalidStateError("replay of a graph that was never captured", backend="fake", call="replay")
        with torch.no_grad():  # a device graph's replay records no autograd either
            self._replay()

    def _replay(self) -> None:
        tensors = self.tensors
        for op in self.ops:
            args = tree_map(lambda a: tensors[a.index] if isinstance(a, _Ref) else a, op.args)
            kwargs = tree_map(lambda a: tensors[a.index] if isinstance(a, _Ref) else a, op.kwargs)
            result = op.func(*args, **kwargs)
            if op.fresh:
                flat, _ = tree_flatten(result)
                for pos, index in op.fresh:
                    tensors[index].copy_(flat[pos])

    def release(self) -> None:
        self.ops.clear()
        self.entries.clear()
        self.tensors.clear()
        if self.own_pool is not None:
            self.own_pool.release()
            self.own_pool = None
        self.released = True
        if self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            on_release(False)


def tensor_at(ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, Any]:
    """A contiguous tensor over ``nbytes`` of host memory at ``ptr``; also return the buffer."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), None
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(shape), buf


def place(pool: BlockPool, out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous copy of ``out`` in a block of ``pool`` (freed when the copy dies); also its address."""
    nbytes = out.numel() * out.element_size()
    ptr = pool.malloc(nbytes) if nbytes else 0
    placed, buf = tensor_at(ptr, nbytes, out.dtype, tuple(out.shape))
    if buf is not None:
        weakref.finalize(buf, pool.free, ptr)
    placed.copy_(out)
    return placed, ptr


class Placer(TorchDispatchMode):
    """Outside captures: every new tensor made inside the mode lives in ``pool`` (fake ``use_pool``)."""

    def __init__(self, pool: BlockPool) -> None:
        super().__init__()
        self.pool = pool

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        storages = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                    if isinstance(a, torch.Tensor) and a.numel()}
        flat, spec = tree_flatten(result)
        for i, out in enumerate(flat):
            if isinstance(out, torch.Tensor) and out.numel() and out.untyped_storage().data_ptr() not in storages:
                flat[i] = place(self.pool, out)[0]
        return tree_unflatten(flat, spec)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeGraph, pool: BlockPool) -> None:
        super().__init__()
        self.graph = graph
        self.pool = pool
        self._index: dict[int, tuple[weakref.ref, int]] = {}

    # -- tensor bookkeeping --------------------------------------------------

    def _lookup(self, t: torch.Tensor) -> int | None:
        hit = self._index.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return None

    def _register(self, t: torch.Tensor, entry: tuple) -> int:
        index = len(self.graph.entries)
        self.graph.entries.append(entry)
        self._index[id(t)] = (weakref.ref(t), index)
        return index

    def _ref(self, a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        index = self._lookup(a)
        if index is None:  # made before the capture: weights, inputs, constants
            index = self._register(a, ("const", a))
        return _Ref(index)

    def _place(self, out: torch.Tensor) -> tuple[torch.Tensor, _Slot]:
        placed, ptr = place(self.pool, out)
        nbytes = out.numel() * out.element_size()
        return placed, _Slot(ptr, nbytes, out.dtype, tuple(out.shape))

    # -- dispatch --------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_SYNC_PACKETS:
            raise CaptureError(
                f"{func} needs a value on the host during a graph capture "
                "(.item(), bool(tensor), printing a tensor or a data-dependent shape); "
                "move it out of the captured function",
                backend="fake", call="capture")
        arg_refs = tree_map(self._ref, args)
        kwarg_refs = tree_map(self._ref, kwargs)
        if torch.Tag.inplace_view in func.tags:  # squeeze_, t_, ...: new metadata, same memory
            result = func(*args, **kwargs)
            # from now on the tensor is a view of what it was; replaying the op itself would
            # change the replay tensor's shape again on every replay
            self._register(args[0], ("view", _functional_view(func), arg_refs, kwarg_refs, 0))
            return result
        in_storages = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor) and a.numel()
        }
        written = [
            kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        result = func(*args, **kwargs)
        flat, spec = tree_flatten(result)
        fresh: list[tuple[int, int]] = []
        for pos, out in enumerate(flat):
            if not isinstance(out, torch.Tensor) or self._lookup(out) is not None:
                continue
            aliases = out.numel() and out.untyped_storage().data_ptr() in in_storages
            target = next((w for w in written if isinstance(w, torch.Tensor)
                           and w.numel() and w.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                           and w.shape == out.shape and w.stride() == out.stride()), None)
            if aliases and target is not None:  # an in-place op returned a new handle on its target
                self._index[id(out)] = (weakref.ref(out), self._ref(target).index)
            elif aliases:
                self._register(out, ("view", func, arg_refs, kwarg_refs, pos))
            else:
                placed, slot = self._place(out)
                flat[pos] = placed
                fresh.append((pos, self._register(placed, ("slot", slot))))
        if fresh or written:
            self.graph.ops.append(_Op(func, arg_refs, kwarg_refs, fresh))
        return tree_unflatten(flat, spec)


def _functional_view(func: Any) -> Any:
    """The view op an in-place view op stands for: ``aten.squeeze_.dim`` -> ``aten.squeeze.dim``."""
    name = func._schema.name.split("::")[-1].rstrip("_")
    return getattr(getattr(aten, name), func._overloadname)


def _materialise(graph: FakeGraph) -> None:
    """Build the replay tensors: fresh views over the placed memory, constants as they are."""
    tensors: list[torch.Tensor | None] = []
    for entry in graph.entries:
        kind = entry[0]
        if kind == "const":
            tensors.append(entry[1])
        elif kind == "slot":
            slot: _Slot = entry[1]
            tensors.append(tensor_at(slot.ptr, slot.nbytes, slot.dtype, slot.shape)[0])
        else:
            _, func, args, kwargs, pos = entry
            args = tree_map(lambda a: tensors[a.index] if isinstance(a, _Ref) else a, args)
            kwargs = tree_map(lambda a: tensors[a.index] if isinstance(a, _Ref) else a, kwargs)
            tensors.append(tree_flatten(func(*args, **kwargs))[0][pos])
    graph.tensors = tensors
    # views only served to rebuild tensors; drop what the ops do not need
    for i, entry in enumerate(graph.entries):
        if entry[0] == "view":
            graph.entries[i] = ("view",)


#: tensor methods that read values on the host without going through torch's dispatcher
HOST_READ_METHODS = ("tolist", "numpy", "__array__", "__repr__", "__str__", "__format__")
_capturing = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0


def _refusing(name: str, original: Any) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if getattr(_capturing, "depth", 0):
            raise CaptureError(
                f"Tensor.{name}() reads values on the host during a graph capture; the graph would replay "
                "with the values seen at capture time. Move it out of the captured function",
                backend="fake", call="capture")
        return original(self, *args, **kwargs)

    method.__name__ = name
    method._hal_original = original  # type: ignore[attr-defined]
    return method


@contextlib.contextmanager
def _host_reads_refused() -> Iterator[None]:
    """On this thread, inside the block, Tensor.tolist(), .numpy(), repr() and print() raise CaptureError.

    They read memory directly, so the recording mode never sees them; on a
    device they would need a host synchronisation, which a capture forbids.
    The methods are wrapped while any capture runs and restored after the last.
    """
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            for name in HOST_READ_METHODS:
                setattr(torch.Tensor, name, _refusing(name, getattr(torch.Tensor, name)))
        _patch_users += 1
    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    try:
        yield
    finally:
        _capturing.depth -= 1
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for name in HOST_READ_METHODS:
                    original = getattr(torch.Tensor, name)._hal_original
                    if name in _ORIGINAL_DICT:
                        setattr(torch.Tensor, name, original)
                    else:
                        delattr(torch.Tensor, name)


_ORIGINAL_DICT = {name for name in HOST_READ_METHODS if name in vars(torch.Tensor)}


@contextlib.contextmanager
def capture(graph: FakeGraph, pool: BlockPool) -> Iterator[FakeGraph]:
    """Record the torch work done inside the block into ``graph``, placing results in ``pool``."""
    if graph.captured or graph.released:
        raise InvalidStateError("a graph can be captured once", backend="fake", call="capture")
    recorder = _Recorder(graph, pool)
    try:
        with recorder, _host_reads_refused():
            yield graph
    except BaseException:
        graph.ops.clear()
        graph.entries.clear()
        raise
    _materialise(graph)
    graph.captured = True
