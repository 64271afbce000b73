"""A custom all-reduce that reads graph buffers in place, registered over graphkit memory without legacy IPC.

vLLM's custom all-reduce -- and its ports in FlashInfer (``flashinfer.comm.vllm_*``) and SGLang -- is one C++
class with one registration protocol. While a graph is captured, each all-reduce call takes the next free slot of
the kernel's ``rank_data`` (a slot holds, for one buffer, its address on every rank) and notes the buffer it will
read. After the captures the engine registers the noted buffers: ``get_graph_buffer_ipc_meta`` (a legacy IPC
handle per buffer), an all-gather of the handles over its process group, then ``register_graph_buffers`` (each
rank opens the peers' handles and writes the addresses into the slots). The driver refuses legacy IPC on memory
mapped through its virtual memory API, all of graphkit's, so over graphkit memory the first call fails.

:func:`serve` (:func:`serve_flashinfer` for FlashInfer) serves that protocol for graphkit memory and passes
everything else to the kernel library unchanged. The engine's code stays as it is: one call at start-up, before
it makes its all-reduce. Then:

* each all-reduce call made while this thread captures notes the buffer and its slot, by the kernel's own rule;
* ``get_graph_buffer_ipc_meta`` returns, in each handle's place, a token of :class:`~graphkit.memory.peers.
  PeerMemory` (what lies under the buffers, to be asked of this process) and offsets of 0, where the noted
  buffers are graphkit memory; the library's own answer where none is;
* ``register_graph_buffers`` resolves every rank's tokens -- the peers' chunks come as POSIX file descriptors
  over a Unix socket and are mapped once each -- and writes each buffer's addresses into its slot. Call it on
  every rank together (engines do): each rank's process answers the others' requests.

Registration follows the chunks. A later registration (after more captures) publishes every buffer again, so a
buffer whose granule a survivor swap gave a chunk of its own is read from that chunk. The :class:`PeerMemory`
of an allocator joins the :class:`~graphkit.MemorySaver` tag that holds the allocator: ``pause()`` releases the
peers' chunks with the rank's own, ``resume()`` maps the peers' new chunks at the same addresses, so the slots
stay right. Memory outside graphkit after a graphkit registration on the same all-reduce is refused (the library
cannot register it any more): capture every graph that uses the all-reduce inside ``graph_memory()``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import hal
from graphkit.memory.allocator import SharedVMMAllocator, allocator_holding
from graphkit.memory.peers import DEFAULT_TIMEOUT, TOKEN_BYTES, PeerMemory, is_token
from graphkit.saver import saver_holding

log = logging.getLogger(__name__)

#: bytes of one slot of ``rank_data``: the kernel's ``RankData``, eight device pointers
SLOT_BYTES = 64
#: bytes of one handle in ``get_graph_buffer_ipc_meta``'s answer (``sizeof(cudaIpcMemHandle_t)``)
HANDLE_BYTES = 64
#: the calls :func:`serve` wraps, by the names vLLM's, FlashInfer's and SGLang's bindings give them
CALLS = ("init_custom_ar", "register_buffer", "all_reduce", "get_graph_buffer_ipc_meta", "register_graph_buffers",
         "dispose")

_ENTRY = struct.Struct("!I")  # after the token, in a handle: the buffer's index in its rank's set


@dataclass
class _Noted:
    """A buffer an all-reduce reads in a captured graph, and the slot of ``rank_data`` the kernel gave it."""

    ptr: int
    nbytes: int
    slot: int  # address of the slot


@dataclass
class _AllReduce:
    """What the kernel library keeps of one all-reduce, followed call by call."""

    rank: int
    world: int
    rank_data: int  # address of rank_data
    rank_data_bytes: int
    base: int  # the library's next free slot, as an index
    unregistered: int = 0  # buffers noted by the library since its last registration of its own
    noted: list[_Noted] = field(default_factory=list)  # buffers waiting for a registration
    registered: list[_Noted] = field(default_factory=list)  # served by graphkit so far (published again each time)
    served: bool = False  # graphkit registered buffers of it: the library's own registration cannot run any more
    meta: tuple[list[_Noted], list[PeerMemory]] | None = None  # the buffers last published, and per buffer the
    # peer memory of its allocator


class ServedAllReduce:
    """The kernel library's registration served for graphkit memory (:func:`serve`); :meth:`close` puts the
    library's calls back. A context manager."""

    def __init__(self, ops: Any, *, timeout: float = DEFAULT_TIMEOUT, backend: hal.Backend | None = None) -> None:
        missing = [name for name in CALLS if not callable(getattr(ops, name, None))]
        if missing:
            raise hal.InvalidArgumentError(f"ops={ops!r} lacks {', '.join(missing)}: pass the binding of a vLLM-style "
                                           "custom all-reduce (flashinfer.comm.vllm_ar.get_vllm_comm_module(), "
                                           "vllm._custom_ops)", call="serve")
        self.ops = ops
        self.timeout = timeout
        self.backend = backend
        self._lock = threading.RLock()
        self._state: dict[int, _AllReduce] = {}
        self._peers: weakref.WeakKeyDictionary[SharedVMMAllocator, PeerMemory] = weakref.WeakKeyDictionary()
        self._original = {name: getattr(ops, name) for name in CALLS}
        own = getattr(ops, "__dict__", {})
        self._inherited = [name for name in CALLS if name not in own]  # from the binding's class: deleted at close
        for name in CALLS:
            setattr(ops, name, getattr(self, "_" + name))
        self._closed = False

    def __enter__(self) -> ServedAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Put the library's calls back (the registrations made stay valid) and close the peer memories."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name, call in self._original.items():
                if name in self._inherited:
                    delattr(self.ops, name)
                else:
                    setattr(self.ops, name, call)
            for peers in list(self._peers.values()):
                peers.close()

    # -- the library's calls --------------------------------------------------------------------------------

    def _init_custom_ar(self, ipc_ptrs: Sequence[int], rank_data: Any, rank: int, *args: Any, **kwargs: Any) -> int:
        fa = self._original["init_custom_ar"](ipc_ptrs, rank_data, rank, *args, **kwargs)
        with self._lock:
            self._state[int(fa)] = _AllReduce(int(rank), len(ipc_ptrs), int(rank_data.data_ptr()),
                                              int(rank_data.numel() * rank_data.element_size()), 0)
        return fa

    def _dispose(self, fa: int, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._state.pop(int(fa), None)
        return self._original["dispose"](fa, *args, **kwargs)

    def _register_buffer(self, fa: int, *args: Any, **kwargs: Any) -> Any:
        result = self._original["register_buffer"](fa, *args, **kwargs)
        with self._lock:
            state = self._state.get(int(fa))
            if state is not None:
                state.base += 1  # the library hands this buffer the next slot
        return result

    def _all_reduce(self, fa: int, inp: Any, out: Any, reg_buffer: int = 0, *args: Any, **kwargs: Any) -> Any:
        state = self._state.get(int(fa))
        if state is not None and self._capturing(inp):
            read = int(reg_buffer) or int(inp.data_ptr())  # the kernel reads the staging buffer where one is given
            with self._lock:
                slot = state.rank_data + (state.base + state.unregistered) * SLOT_BYTES
                state.unregistered += 1
                state.noted.append(_Noted(read, int(inp.numel() * inp.element_size()), slot))
        return self._original["all_reduce"](fa, inp, out, reg_buffer, *args, **kwargs)

    def _capturing(self, tensor: Any) -> bool:
        if self.backend is not None:
            return self.backend.capturing()
        import torch

        return bool(tensor.is_cuda and torch.cuda.is_current_stream_capturing())

    def _get_graph_buffer_ipc_meta(self, fa: int, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        with self._lock:
            state = self._state.get(int(fa))
            if state is None:
                return self._original["get_graph_buffer_ipc_meta"](fa, *args, **kwargs)
            owners = [allocator_holding(n.ptr) for n in state.noted]
            if not state.served and not any(owners):
                return self._original["get_graph_buffer_ipc_meta"](fa, *args, **kwargs)
            every = state.registered + state.noted  # published again: a survivor swap moves what lies under one
            owners = [allocator_holding(n.ptr) for n in every]
            outside = sum(owner is None for owner in owners)
            if outside:
                raise hal.InvalidStateError(
                    f"{outside} buffer(s) the all-reduce reads are outside graphkit memory, next to graphkit's: "
                    "capture every graph that uses this all-reduce inside graph_memory() (or under the switch)",
                    call="get_graph_buffer_ipc_meta")
            entries: list[bytes] = [b""] * len(every)
            by_buffer: list[PeerMemory] = [None] * len(every)  # type: ignore[list-item]
            for allocator in {id(o): o for o in owners if o is not None}.values():
                mine = [i for i, owner in enumerate(owners) if owner is allocator]
                peers = self._peer_memory(allocator)
                token = peers.publish([(every[i].ptr, every[i].nbytes) for i in mine])
                for j, i in enumerate(mine):
                    entries[i] = (token + _ENTRY.pack(j)).ljust(HANDLE_BYTES, b"\0")
                    by_buffer[i] = peers
            state.meta = (every, by_buffer)
            return list(b"".join(entries)), [0] * len(every)

    def _register_graph_buffers(self, fa: int, handles: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]],
                                *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            state = self._state.get(int(fa))
            ours = [bytes(v & 0xFF for v in h[:TOKEN_BYTES]) for h in handles]
            if state is None or not any(is_token(h) for h in ours):
                result = self._original["register_graph_buffers"](fa, handles, offsets, *args, **kwargs)
                if state is not None:  # the library wrote its slots and moved on past them
                    state.base += state.unregistered
                    state.unregistered = 0
                    state.noted.clear()
                return result
            if state.meta is None or len(handles) != state.world or not all(is_token(h) for h in ours):
                raise hal.InvalidArgumentError(
                    f"handles for {len(handles)} rank(s), {sum(map(is_token, ours))} of graphkit: pass every rank's "
                    "answer of get_graph_buffer_ipc_meta, called on every rank after the same captures",
                    call="register_graph_buffers")
            every, by_buffer = state.meta
            addresses = [[n.ptr for n in every] if rank == state.rank else
                         self._addresses(by_buffer, h, len(every), rank) for rank, h in enumerate(handles)]
            self._write_slots(state, every, addresses, by_buffer[0])
            state.registered, state.noted, state.meta, state.served = every, [], None, True
            log.info("all-reduce %#x: %d graph buffer(s) registered over graphkit memory on %d rank(s)", int(fa),
                     len(every), state.world)
            return None

    # -- graphkit's registration ------------------------------------------------------------------------------

    def _peer_memory(self, allocator: SharedVMMAllocator) -> PeerMemory:
        """The allocator's peer memory, made once and joined to the saver tag that holds the allocator."""
        peers = self._peers.get(allocator)
        if peers is None or peers.closed:
            peers = self._peers[allocator] = PeerMemory(allocator, timeout=self.timeout)
            held = saver_holding(allocator)
            if held is not None:
                peers.adopt(held[0], held[1])
        return peers

    @staticmethod
    def _addresses(by_buffer: list[PeerMemory], handle: Sequence[int], count: int, rank: int) -> list[int]:
        """One rank's ``count`` buffers, at their addresses in this process: each mapped by the peer memory of
        this rank's buffer at the same place (so that it sleeps and wakes with the memory of that buffer)."""
        data = bytes(v & 0xFF for v in handle)
        if len(data) != count * HANDLE_BYTES:
            raise hal.InvalidArgumentError(f"rank {rank} registered {len(data) // HANDLE_BYTES} buffer(s), this rank "
                                           f"{count}: every rank must capture the same graphs",
                                           call="register_graph_buffers")
        resolved: dict[tuple[int, bytes], list[int]] = {}  # a set per allocator of the rank's, resolved once each
        addresses = []
        for i in range(count):
            entry = data[i * HANDLE_BYTES:(i + 1) * HANDLE_BYTES]
            key = (id(by_buffer[i]), entry[:TOKEN_BYTES])
            if key not in resolved:
                resolved[key] = by_buffer[i].resolve(key[1])
            addresses.append(resolved[key][_ENTRY.unpack_from(entry, TOKEN_BYTES)[0]])
        return addresses

    def _write_slots(self, state: _AllReduce, every: list[_Noted], addresses: list[list[int]],
                     peers: PeerMemory) -> None:
        """Each buffer's address on every rank, written into its slot of ``rank_data`` (as the library does)."""
        end = state.rank_data + state.rank_data_bytes
        last = max((n.slot for n in every), default=state.rank_data)
        if last + SLOT_BYTES > end:
            raise hal.InvalidArgumentError(
                f"rank_data holds {state.rank_data_bytes // SLOT_BYTES} slots; the graphs' all-reduces need "
                f"{(last - state.rank_data) // SLOT_BYTES + 1}: make rank_data larger", call="register_graph_buffers")
        be = peers.backend
        for i, noted in enumerate(every):
            slot = bytearray(SLOT_BYTES)
            for rank in range(state.world):
                struct.pack_into("=Q", slot, 8 * rank, addresses[rank][i])
            be.tensor_at(noted.slot, SLOT_BYTES).copy_(_host_bytes(bytes(slot)))
        be.synchronize()


def _host_bytes(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def serve(ops: Any, *, timeout: float = DEFAULT_TIMEOUT, backend: hal.Backend | None = None) -> ServedAllReduce:
    """Serve the graph-buffer registration of the vLLM-style all-reduce bound as ``ops`` for graphkit memory.

    :param ops: the binding whose calls the engine makes (``init_custom_ar``, ``all_reduce``,
        ``register_buffer``, ``get_graph_buffer_ipc_meta``, ``register_graph_buffers``, ``dispose``), patched in
        place: FlashInfer's (:func:`serve_flashinfer`), vLLM's ``vllm._custom_ops``.
    :param timeout: seconds a rank waits for a peer during a registration or a resume.
    :param backend: the hal backend whose capture state tells a captured call (default: the framework's: torch's
        current CUDA stream).
    """
    return ServedAllReduce(ops, timeout=timeout, backend=backend)


def serve_flashinfer(*, timeout: float = DEFAULT_TIMEOUT) -> ServedAllReduce:
    """:func:`serve` for FlashInfer's vLLM-style all-reduce (``flashinfer.comm.vllm_*``); builds or loads its
    module (FlashInfer's JIT) if it is not loaded yet."""
    try:
        vllm_ar = importlib.import_module("flashinfer.comm.vllm_ar")
    except ImportError as exc:
        raise hal.UnsupportedError(f"FlashInfer is not importable ({exc}): pip install flashinfer-python",
                                   call="serve_flashinfer") from exc
    return serve(vllm_ar.get_vllm_comm_module(), timeout=timeout)


# -- served from the switch: as soon as the binding is imported ------------------------------------------------

#: the module whose import a target names; FlashInfer's binding is a namespace its module builds on first use
_FLASHINFER = "flashinfer.comm.vllm_ar"


def serve_on_import(target: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Serve ``target``'s registration as soon as its binding is imported (now, where it is): ``"flashinfer"``
    (FlashInfer's ``flashinfer.comm.vllm_*``: its namespace, once built) or a binding module with the calls of
    :data:`CALLS` (``"vllm._custom_ops"``). What the switch's ``allreduce=`` option does in every process.

    A binding that lacks a call is not served and logs why (an engine's start must not fail over it).
    """
    name = _FLASHINFER if target == "flashinfer" else target
    module = sys.modules.get(name)
    if module is not None:
        _serve_module(module, target, timeout)
    elif not any(isinstance(f, _ServeOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _ServeOnImport(name, lambda m: _serve_module(m, target, timeout)))


def _serve_module(module: ModuleType, target: str, timeout: float) -> None:
    if target != "flashinfer":
        try:
            serve(module, timeout=timeout)
        except hal.HalError as exc:
            log.warning("allreduce=%s: not served: %s", target, exc)
        return
    build = module.get_vllm_comm_module  # cached: the namespace the module's calls go through
    served: list[ServedAllReduce] = []
    lock = threading.Lock()

    def get_vllm_comm_module() -> Any:
        namespace = build()
        with lock:
            if not served:
                served.append(serve(namespace, timeout=timeout))
        return namespace

    module.get_vllm_comm_module = get_vllm_comm_module  # type: ignore[attr-defined]


class _ServeOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: once the module ``name`` is imported by the other finders, hands it to ``then``."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once: the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A loader that runs ``loader``'s module, then ``then`` on it."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)


def sharing_options(backend: str) -> dict[str, Any]:
    """The options that make ``backend``'s chunks shareable with another process, for :func:`hal.get_backend`
    (cuda's are not by default: shareable chunks change what NCCL does with graph memory; docs/engines.md)."""
    return {"shareable": True} if backend == "cuda" else {}


__all__ = ["CALLS", "HANDLE_BYTES", "SLOT_BYTES", "ServedAllReduce", "serve", "serve_flashinfer", "serve_on_import",
           "sharing_options"]
