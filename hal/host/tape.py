"""The host recorder's graph: a recording tape of torch ops.

Capture runs the user's function once under a ``TorchDispatchMode``:

* every result that is not a view of an existing tensor is placed at an
  address handed out by the capture's pool (so intermediates really live in
  the pool's memory, e.g. a virtual space of graphkit's allocator), and the
  op is recorded;
* ops that write into their arguments (in-place, ``out=``) are recorded too;
* views are recorded once, to be rebuilt over the placed memory;
* a tensor made before the capture is recorded as it is when the capture
  first sees it; an op that changes in place which elements a tensor shows
  (``t_``, ``squeeze_``, ``resize_``, an ``out=`` argument torch resizes)
  records it anew over the same memory, and an empty tensor that such an op
  gives memory gets that memory in the pool. What the replay could not
  follow (a tensor of the pool grown, one made before the capture grown,
  ``set_`` onto a bare storage) raises :class:`hal.CaptureError` naming the op.

Replay re-runs the recorded ops on the same addresses, never the
Python function, so its cost is proportional to the ops recorded. Ops that
synchronise with the host (``.item()``, ``bool(t)``, printing) raise
:class:`hal.CaptureError`, as they do inside a CUDA graph capture.

At the end of a capture the tape is compiled into a flat program (see
:func:`_compile`): every step is a pre-bound ``(callable, args, kwargs)``
with its tensor arguments resolved once, and an op whose results were
placed writes them straight into their placed memory through its ``out=``
overload, so a replay neither allocates, copies nor walks pytrees for it.
Ops without such an overload, random ops, and ops whose placed output
overlaps one of their inputs (possible through a weak alias into a shared
pool) run as recorded and their results are copied into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hal.errors import CaptureError, InvalidArgumentError, InvalidStateError
from hal.host.pool import BlockPool
from hal.transaction import Transaction
from hal.types import GraphAddresses

aten = torch.ops.aten
log = logging.getLogger("hal.host")

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

#: ops whose output shape always depends on the data (a replay could not follow it)
_DATA_SHAPE_OPS = {aten.bincount.default, aten._unique.default}


def _data_dependent_shape(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the output shape of ``func`` depends on the values of its arguments, not only on their shapes: a
    boolean-mask index (``a[mask]``: how many elements are true), ``repeat_interleave`` by a tensor without
    ``output_size`` (the sum of the repeats), ``bincount`` (the largest value). A replay keeps the shape the capture
    saw, so such an op is refused like the host-synchronising ones (a CUDA capture refuses them too)."""
    if func in _DATA_SHAPE_OPS:
        return True
    if func is aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func.overloadpacket is aten.repeat_interleave:
        repeats = args[0] if func is aten.repeat_interleave.Tensor else (args[1] if len(args) > 1 else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


@dataclass
class _Slot:
    """A tensor placed in the pool: where it lives and how to view it."""

    ptr: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None  # None: contiguous


@dataclass
class _Op:
    func: Any
    args: Any  # pytree with tensors replaced by _Ref
    kwargs: Any
    fresh: list[tuple[int, int]]  # (output position in the flat result, tensor index)


@dataclass(frozen=True)
class _Ref:
    index: int  # into HostGraph._tensors


#: one step of a compiled replay: ``fn(*args, **kwargs)``
_Step = tuple[Callable[..., Any], tuple, dict]

_SERIALS = itertools.count(1)  # HostGraph.serial


@dataclass
class HostGraph:
    """A captured tape; build with the backend's ``create_graph``.

    ``backend`` names the backend in errors. ``own_pool`` is the private
    pool of a capture given no pool: released with the graph.
    """

    backend: str = "host"
    ops: list[_Op] = field(default_factory=list)
    # each recorded tensor: ("slot", _Slot) | ("view", func, args, kwargs, position) | ("const", tensor)
    # | ("strided", base tensor index, shape, strides, storage offset)
    entries: list[tuple] = field(default_factory=list)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    # what a replay runs: ``fn(*args, **kwargs)`` per step, built from ``ops`` at the end of the capture
    program: list[_Step] = field(default_factory=list)
    own_pool: BlockPool | None = None
    pool: BlockPool | None = None  # the pool the capture placed its results in
    # the tensors whose bytes a replay reads or writes (indices into ``tensors``), found at the end of the capture
    touched: list[int] = field(default_factory=list)
    # integer arguments of the recorded ops that could be addresses (see :func:`_words`)
    words: list[int] = field(default_factory=list)
    capturing: bool = False
    captured: bool = False
    released: bool = False
    on_release: Any = None  # set by a routed capture: told once when the graph is released
    #: compile the tape at the first replay rather than at the end of the capture (``create_graph(lazy=True)``)
    lazy: bool = False
    compiled: bool = False  # ``program`` is built (the tape's "instantiation")
    #: the graph whose tape ``program`` runs since an update (``update_graph``); None: this graph's own
    running: HostGraph | None = None
    #: set by a route that owns the graph's replays (:attr:`hal.types.Route.on_replay`)
    on_replay: Any = None
    #: unique in the process, never reused (unlike ``id()``, which a new graph may get once this one is gone)
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False)

    def replay(self) -> None:
        pool = (self.running or self).pool
        if not self.captured or self.released or (pool is not None and pool.released):
            raise self._not_replayable()
        if not self.compiled:
            self.program, self.compiled = _compile(self), True
        with torch.no_grad():  # a device graph's replay records no autograd either
            self._replay()

    def _not_replayable(self) -> InvalidStateError:
        if self.released:
            why = "the graph was released (release_graph); capture a new graph to replay this work"
        elif not self.captured:
            why = "replay of a graph that was never captured"
        else:
            pool = (self.running or self).pool
            why = (f"the pool the graph was captured into was released ({pool.name if pool else '?'}), "
                   "so the memory its replay reads and writes is gone; capture the graph again into a live pool")
        return InvalidStateError(why, backend=self.backend, call="replay")

    def _replay(self) -> None:
        for fn, args, kwargs in self.program:
            fn(*args, **kwargs)

    def addresses(self) -> GraphAddresses:
        """Every byte span a replay reads or writes: the storage of each tensor whose bytes a recorded op reads
        or writes (a tensor an op takes only for its shape and dtype, as ``zeros_like`` does, is not counted);
        and, as bare words (``nbytes=1``), the integer arguments of the ops that could be addresses, as a device
        backend reports the words of its kernels' arguments: whether an op dereferences one, only a replay tells."""
        if not self.captured or self.released:
            raise InvalidStateError("graph_addresses of a graph that is not captured", backend=self.backend,
                                    call="graph_addresses")
        start = time.perf_counter()
        tape = self.running or self  # what its replays use
        used = (tape.tensors[i] for i in tape.touched)
        spans = {(s.data_ptr(), s.nbytes()) for s in
                 (t.untyped_storage() for t in used if t is not None and t.numel())}
        spans.update((word, 1) for word in tape.words)
        return GraphAddresses(tuple(sorted(spans)), nodes=len(self.ops), seconds=time.perf_counter() - start)

    def discard(self) -> None:
        """Forget a capture that was refused after it ended: the graph is empty again, as after a failed one."""
        self._forget()
        self.captured = False

    def _forget(self) -> None:
        self.program.clear()
        self.compiled = False
        self.ops.clear()
        self.entries.clear()
        self.tensors.clear()
        self.touched.clear()
        self.words.clear()
        self.pool = None
        self.running = None

    def release(self) -> None:
        """Drop the tape and the private pool; tell a routed capture's router once. Idempotent."""
        self._forget()
        if self.own_pool is not None:
            self.own_pool.release()
            self.own_pool = None
        self.released = True
        if self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            on_release(False)


def tensor_at(ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
              stride: tuple[int, ...] | None = None) -> tuple[torch.Tensor, Any]:
    """A tensor over ``nbytes`` of host memory at ``ptr``, contiguous or with ``stride``; also return the buffer."""
    if nbytes == 0:
        empty = torch.empty(shape, dtype=dtype) if stride is None else torch.empty_strided(shape, stride, dtype=dtype)
        return empty, None
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    return (flat.view(shape) if stride is None else flat.as_strided(shape, stride)), buf


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block without gaps or overlaps, in any dimension order (as an op's
    result laid out like a permuted input is)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def place(pool: BlockPool, out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A copy of ``out`` in a block of ``pool``, laid out as ``out`` is where it is dense (else contiguous),
    freed when the copy dies; also its address."""
    nbytes = out.numel() * out.element_size()
    ptr = pool.malloc(nbytes) if nbytes else 0
    stride = tuple(out.stride()) if _dense(out) and not out.is_contiguous() else None
    placed, buf = tensor_at(ptr, nbytes, out.dtype, tuple(out.shape), stride)
    if buf is not None:
        weakref.finalize(buf, pool.free, ptr)
    placed.copy_(out)
    return placed, ptr


class Placer(TorchDispatchMode):
    """Outside captures: every new tensor made inside the mode lives in ``pool`` (``use_pool``)."""

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


#: where a tensor's elements are: (memory address, memory bytes, shape, strides, offset)
_Layout = tuple[int, int, tuple[int, ...], tuple[int, ...], int]


def _layout(t: torch.Tensor) -> _Layout:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), tuple(t.shape), t.stride(), int(t.storage_offset())


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple, kwargs: dict) -> list[tuple[int | str, Any]]:
    """``(position or name, value)`` of every argument ``func`` writes: an in-place target, an ``out=``."""
    found: list[tuple[int | str, Any]] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only or i >= len(args):
                found.append((a.name, kwargs.get(a.name)))
            else:
                found.append((i, args[i]))
    return found


@functools.cache
def _shape_only(func: Any) -> frozenset[str]:
    """The arguments ``func`` takes for their shape, dtype and device only, never reading their bytes.

    ``zeros_like(self)``, ``empty_like``, ``full_like``, ``rand_like``...
    and ``self.new_zeros(...)``, ``new_empty``...: aten names them so.
    """
    name = func._schema.name.split("::")[-1]
    return frozenset({"self"}) if name.endswith("_like") or name.startswith("new_") else frozenset()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: HostGraph, pool: BlockPool) -> None:
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
            # an alias keeps the shape and strides the tensor has now, whatever t_() or squeeze_() do to it later
            index = self._register(a, ("const", aten.alias.default(a)))
        return _Ref(index)

    def _place(self, out: torch.Tensor) -> tuple[torch.Tensor, _Slot]:
        placed, ptr = place(self.pool, out)
        nbytes = out.numel() * out.element_size()
        stride = None if placed.is_contiguous() else tuple(placed.stride())
        return placed, _Slot(ptr, nbytes, out.dtype, tuple(out.shape), stride)

    def _refuse(self, func: Any, why: str) -> CaptureError:
        return CaptureError(f"{func} {why}", backend=self.graph.backend, call="capture")

    # -- dispatch --------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_SYNC_PACKETS:
            raise self._refuse(func, "needs a value on the host during a graph capture "
                                     "(.item(), bool(tensor), printing a tensor or a data-dependent shape); "
                                     "move it out of the captured function")
        if _data_dependent_shape(func, args, kwargs):
            raise self._refuse(func, "gives an output whose shape depends on the data (a boolean mask index, "
                                     "repeat_interleave by a tensor without output_size=, bincount): a replay would "
                                     "keep the shape of the capture; index with integer indices, torch.where or "
                                     "masked_fill, or give the size (output_size=), or move it out of the captured "
                                     "function")
        arg_refs = tree_map(self._ref, args)
        kwarg_refs = tree_map(self._ref, kwargs)
        in_storages = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor) and a.numel()
        }
        written = _written(func, args, kwargs)
        before = {id(t): _layout(t) for _, value in written for t in _tensors(value)}
        result = self._run(func, args, kwargs)
        for key, value in written:  # t_(), resize_(), an out= resized: the tensor shows other elements now
            moved = [t for t in _tensors(value) if _layout(t) != before[id(t)]]
            for t in moved:
                self._rebind(func, t, before[id(t)], args, kwargs)
            if moved and isinstance(key, int):
                arg_refs = (*arg_refs[:key], tree_map(self._ref, value), *arg_refs[key + 1:])
            elif moved:
                kwarg_refs = {**kwarg_refs, key: tree_map(self._ref, value)}
        flat, spec = tree_flatten(result)
        fresh = self._results(flat, in_storages, [w for _, value in written for w in _tensors(value)],
                              func, arg_refs, kwarg_refs)
        if (fresh or written) and torch.Tag.inplace_view not in func.tags:  # an in-place view op moves no bytes
            self.graph.ops.append(_Op(func, arg_refs, kwarg_refs, fresh))
        return tree_unflatten(flat, spec)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            # torch's words for a resize of memory it does not own: here, a block of the graph's pool
            if "not resizable" not in str(exc):
                raise
            raise self._refuse(func, "grows a tensor that lives in the graph's pool, and a block of the pool "
                                     "cannot move; make the tensor at its final size (or empty, torch.empty(0), "
                                     "for an out= argument)") from exc

    def _results(self, flat: list[Any], in_storages: set[int], written: list[torch.Tensor], func: Any,
                 arg_refs: Any, kwarg_refs: Any) -> list[tuple[int, int]]:
        """Register the op's results: new ones are placed in the pool (returned: (position, tensor index))."""
        fresh: list[tuple[int, int]] = []
        for pos, out in enumerate(flat):
            if not isinstance(out, torch.Tensor) or self._lookup(out) is not None:
                continue
            aliases = out.numel() and out.untyped_storage().data_ptr() in in_storages
            target = next((w for w in written
                           if w.numel() and w.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                           and w.shape == out.shape and w.stride() == out.stride()), None)
            if aliases and target is not None:  # an in-place op returned a new handle on its target
                self._index[id(out)] = (weakref.ref(out), self._ref(target).index)
            elif aliases:
                self._register(out, ("view", func, arg_refs, kwarg_refs, pos))
            else:
                placed, slot = self._place(out)
                flat[pos] = placed
                fresh.append((pos, self._register(placed, ("slot", slot))))
        return fresh

    def _rebind(self, func: Any, t: torch.Tensor, before: _Layout, args: tuple, kwargs: dict) -> None:
        """``func`` changed in place which elements ``t`` shows: record ``t`` anew, over the memory it shows now."""
        storage = t.untyped_storage()
        shown = (tuple(t.shape), t.stride(), t.storage_offset())
        if (storage.data_ptr(), storage.nbytes()) == before[:2]:  # same memory: t_(), squeeze_(), a smaller resize_()
            self._register(t, ("strided", self._ref(t).index, *shown))
            return
        sources = [a for a in _tensors((args, kwargs))
                   if a is not t and storage.nbytes() and a.untyped_storage().data_ptr() == storage.data_ptr()]
        if sources:  # set_(source): now over another tensor's memory
            self._register(t, ("strided", self._ref(sources[0]).index, *shown))
        elif not storage.nbytes():  # set_(): no memory at all
            self._register(t, ("slot", _Slot(0, 0, t.dtype, tuple(t.shape), tuple(t.stride()))))
        elif func.overloadpacket is aten.set_:  # onto a storage: the graph holds it, as it holds an input
            self._register(t, ("const", aten.alias.default(t)))
        elif not before[1]:  # an empty tensor given memory (out= resized it, or resize_): it belongs in the pool
            placed, slot = self._place(t)
            t.set_(placed)  # type: ignore[call-overload]
            self._register(t, ("slot", slot))
        else:
            raise self._refuse(func, "grew a tensor made before the capture, so its memory moved where the replay "
                                     "cannot follow; give the tensor its final size before the capture, or make "
                                     "it inside the capture")


def _touched(graph: HostGraph) -> list[int]:
    """The tensors whose bytes the recorded ops read or write: every argument and result, less the arguments
    an op takes for their shape only (:func:`_shape_only`)."""
    found: set[int] = set()
    for op in graph.ops:
        skip = _shape_only(op.func)
        names = (a.name for a in op.func._schema.arguments)  # the positional ones come first
        named = [*zip(names, op.args, strict=False), *op.kwargs.items()]
        for name, value in named:
            if name not in skip:
                found.update(leaf.index for leaf in tree_flatten(value)[0] if isinstance(leaf, _Ref))
        found.update(index for _, index in op.fresh)
    return sorted(found)


#: an integer argument is a candidate address inside [WORD_LOW, WORD_HIGH): above small integers (sizes, dims)
#: and below the top of a 57-bit user address space, as the cuda backend reads kernel arguments
WORD_LOW, WORD_HIGH = 1 << 16, 1 << 57


def _words(graph: HostGraph) -> list[int]:
    """The distinct integer arguments of the recorded ops that could be addresses (a custom op may take one as
    an ``int`` and read or write through it, or carry a number that only looks like one)."""
    found = {leaf for op in graph.ops for leaf in tree_flatten((op.args, op.kwargs))[0]
             if type(leaf) is int and WORD_LOW <= leaf < WORD_HIGH}
    return sorted(found)


def _materialise(graph: HostGraph) -> None:
    """Build the replay tensors: fresh views over the placed memory, constants as they are."""
    tensors: list[torch.Tensor | None] = []
    for entry in graph.entries:
        kind = entry[0]
        if kind == "const":
            tensors.append(entry[1])
        elif kind == "strided":  # what a tensor shows after an in-place view op or a resize
            _, base, shape, stride, offset = entry
            tensors.append(tensors[base].as_strided(shape, stride, offset))
        elif kind == "slot":
            slot: _Slot = entry[1]
            tensors.append(tensor_at(slot.ptr, slot.nbytes, slot.dtype, slot.shape, slot.stride)[0])
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


# -- the compiled replay ------------------------------------------------------------


def _is_write(arg: Any) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


@functools.cache
def _out_variant(func: Any) -> tuple[Callable[..., Any], tuple[str, ...]] | None:
    """The ``out=`` overload of a functional op and its out argument names (one per return), or None.

    Only for ops that write nothing, return plain tensors, draw no random
    numbers, and whose out overload takes exactly the same arguments plus
    keyword-only outs (``aten.mean.dim`` -> ``aten.mean.out``).
    """
    try:
        return _find_out_variant(func)
    except Exception:  # not an OpOverload as aten's are: run it as recorded
        log.debug("no out= lookup for %s", func, exc_info=True)
        return None


def _find_out_variant(func: Any) -> tuple[Callable[..., Any], tuple[str, ...]] | None:
    schema = func._schema
    returns = schema.returns
    if (not returns or schema.is_mutable or any(a.alias_info is not None for a in schema.arguments)
            or any(str(r.type) != "Tensor" or r.alias_info is not None for r in returns)
            or torch.Tag.nondeterministic_seeded in func.tags):
        return None
    want = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = [a for a in arguments if _is_write(a)]
        if (len(outs) != len(returns) or not all(a.kwarg_only and str(a.type) == "Tensor" for a in outs)
                or any(a.alias_info is not None and not _is_write(a) for a in arguments)):
            continue
        if [(a.name, str(a.type), a.kwarg_only) for a in arguments if not _is_write(a)] == want:
            return candidate._op, tuple(a.name for a in outs)
    return None


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of ``t``'s storage, or None for an empty tensor."""
    if not t.numel():
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlaps(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    spans = [s for s in map(_span, inputs) if s is not None]
    for out in outs:
        mine = _span(out)
        if mine is not None and any(lo < mine[1] and mine[0] < hi for lo, hi in spans):
            return True
    return False


def _copying_step(fn: Callable[..., Any], args: tuple, kwargs: dict,
                  targets: list[tuple[int, torch.Tensor]]) -> _Step:
    """Run ``fn`` as recorded, then copy its fresh results into their placed tensors."""
    if len(targets) == 1 and targets[0][0] == 0:
        target = targets[0][1]

        def run_one() -> None:
            result = fn(*args, **kwargs)
            target.copy_(result if isinstance(result, torch.Tensor) else tree_flatten(result)[0][0])

        return run_one, (), {}

    def run() -> None:
        flat, _ = tree_flatten(fn(*args, **kwargs))
        for pos, target in targets:
            target.copy_(flat[pos])

    return run, (), {}


def _compile(graph: HostGraph) -> list[_Step]:
    """Turn the tape into pre-bound steps over the replay tensors (see the module doc)."""
    tensors = graph.tensors

    def resolve(tree: Any) -> Any:
        return tree_map(lambda a: tensors[a.index] if isinstance(a, _Ref) else a, tree)

    program: list[_Step] = []
    direct = copied = 0
    for op in graph.ops:
        args, kwargs = tuple(resolve(op.args)), dict(resolve(op.kwargs))
        fn = getattr(op.func, "_op", op.func)  # the C++ callable, without OpOverload.__call__'s frame
        if not op.fresh:  # in place or out=: writes where it wrote at capture
            program.append((fn, args, kwargs))
            continue
        targets: list[tuple[int, torch.Tensor]] = []
        for pos, index in op.fresh:
            target = tensors[index]
            assert target is not None  # every slot was materialised
            targets.append((pos, target))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out = _out_variant(op.func)
        if (out is not None and sorted(pos for pos, _ in targets) == list(range(len(out[1])))
                and not _overlaps([t for _, t in targets], inputs)):
            out_fn, names = out
            by_pos = dict(targets)
            program.append((out_fn, args, {**kwargs, **{name: by_pos[i] for i, name in enumerate(names)}}))
            direct += 1
        else:
            program.append(_copying_step(fn, args, kwargs, targets))
            copied += 1
    log.debug("compiled %d ops: %d write through out=, %d copy their results", len(graph.ops), direct, copied)
    return program


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
                backend=getattr(_capturing, "backend", "host"), call="capture")
        return original(self, *args, **kwargs)

    method.__name__ = name
    method._hal_original = original  # type: ignore[attr-defined]
    return method


@contextlib.contextmanager
def _host_reads_refused(backend: str) -> Iterator[None]:
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
    outer, _capturing.backend = getattr(_capturing, "backend", backend), backend
    try:
        yield
    finally:
        _capturing.depth -= 1
        _capturing.backend = outer
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


def capturing(backend: str) -> bool:
    """Whether this thread records a capture of ``backend`` now (the innermost capture's backend)."""
    return bool(getattr(_capturing, "depth", 0)) and getattr(_capturing, "backend", None) == backend


def update(graph: HostGraph, source: HostGraph) -> None:
    """Make ``graph`` replay ``source``'s tape from now on: the same ops in the same order (the tape's topology),
    on ``source``'s tensors. ``source`` stays uncompiled, as a device graph stays uninstantiated."""
    for name, g in (("graph", graph), ("source", source)):
        if g.released or not g.captured:
            raise InvalidStateError(f"{name} is not captured", backend=graph.backend, call="update_graph")
    if not source.lazy:
        raise InvalidArgumentError("source was not created with create_graph(lazy=True): only a lazy graph keeps "
                                   "the captured graph an update reads", backend=graph.backend, call="update_graph")
    mine, theirs = [op.func for op in graph.ops], [op.func for op in source.ops]
    if mine != theirs:
        common = zip(mine, theirs, strict=False)
        at = next((i for i, (a, b) in enumerate(common) if a != b), min(len(mine), len(theirs)))
        raise InvalidArgumentError(f"source's topology differs from graph's: {len(theirs)} op(s) against "
                                   f"{len(mine)}, first different at op {at}; capture it into a graph of its own",
                                   backend=graph.backend, call="update_graph")
    graph.program, graph.compiled = _compile(source), True
    graph.running = None if source is graph else source


def refuse_capture(graph: HostGraph) -> None:
    """Raise :class:`hal.InvalidStateError` when ``graph`` cannot be captured now (before anything is set up)."""
    if graph.capturing:
        raise InvalidStateError("the graph is being captured already: a capture of it inside its own capture "
                                "would record itself; capture into another graph", backend=graph.backend,
                                call="capture")
    if graph.captured or graph.released:
        raise InvalidStateError("a graph can be captured once", backend=graph.backend, call="capture")


@contextlib.contextmanager
def capture(graph: HostGraph, pool: BlockPool) -> Iterator[HostGraph]:
    """Record the torch work done inside the block into ``graph``, placing results in ``pool``."""
    refuse_capture(graph)
    recorder = _Recorder(graph, pool)
    graph.capturing = True
    try:
        with Transaction() as tx:
            tx.append(lambda: graph.entries.clear())  # a failed recording leaves nothing recorded
            tx.append(lambda: graph.ops.clear())
            with recorder, _host_reads_refused(graph.backend):
                yield graph
            tx.commit()
    finally:
        graph.capturing = False
    _materialise(graph)
    graph.touched = _touched(graph)
    graph.words = _words(graph)
    if not graph.lazy:
        graph.program, graph.compiled = _compile(graph), True
    graph.pool = pool
    graph.captured = True
