"""Two engine processes take turns on one device and pay for its graph memory once.

Each process runs the engine of ``examples/engine-decode`` (imported from its
file) with a model of its own and its own capture loop. The **exporter**
captures its graphs with ``graphkit.GraphPools(outputs="replay")`` (one
space per batch size over shared chunks; the engines read a step's outputs
right after its replay), then sends its chunks to the **importer** over a Unix
socket (``graphkit.memory.sharing``); the importer captures its graphs into
spaces mapped onto those same chunks (:class:`ImportedSpaces`) and creates
none. Both graphs' bytes are the same physical memory, so:

**The turn rule**: an exclusive ``fcntl.flock`` on one file, held around each
step -- copying the inputs in, the replay, and reading its outputs (they live
in the shared bytes, which the other process's next replay overwrites). No
two processes replay at once. The kernel releases the lock of a process that
dies, so a crashed holder never blocks the other: its next replay writes the
bytes it reads afresh, and its results stay exact.

The KV caches are elastic (``--kv elastic``): each engine maps the blocks of
the batch it decodes for that decoding and gives them back after it.

The independent run starts the same two engines each with pools of its own,
for comparison: graph memory, the step at batch 1, and the cost of a turn
(taking and giving back the uncontended lock) against the step.

    python examples/turns/turns.py --backend fake
    python examples/turns/turns.py --backend fake --crash     # the importer dies holding the turn
    python examples/turns/turns.py --backend cuda             # a GPU: chunks exported as file descriptors
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import queue
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import graphkit
import hal
from graphkit.graphs.capture import release_cached_memory
from graphkit.memory.sharing import ImportedSpaces, export_handles, receive_spaces, send_range
from hal.types import fmt_bytes

log = logging.getLogger("turns")

ENGINE_PATH = Path(__file__).resolve().parents[1] / "engine-decode" / "engine.py"
#: backend options: small granules on ``fake``; exportable chunks on cuda (``shareable=True``: memory_sharing)
BACKEND_OPTIONS: dict[str, dict[str, Any]] = {"fake": {"granularity": 1 << 16}, "cuda": {"shareable": True}}
SIZES = (1, 2, 4, 8)
#: tokens per sequence at most; an elastic KV cache reserves (not maps) this much for the largest batch
MAX_MODEL_LEN = 64
#: the batch sizes each engine captures, per --config
REFERENCE_SIZES = (1, 2, 4, 8, 16, 32, 48, 64)
CONFIG_SIZES = {"tiny": SIZES, "reference": REFERENCE_SIZES, "twins": REFERENCE_SIZES}
MODES = ("shared", "independent")
ROLES = ("exporter", "importer")
#: seconds a child waits for its peer at each meeting point (the socket, the barrier)
MEETING_TIMEOUT = 300.0


def load_engine_module() -> ModuleType:
    """The engine of ``examples/engine-decode``, imported from its file."""
    name = "turns_engine_decode"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ENGINE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


engine_decode = load_engine_module()
ModelConfig = engine_decode.ModelConfig

#: one model per role and --config; the exporter's graphs are the larger (the importer's must fit in its chunks).
#: ``reference`` (a GPU): a Qwen3-0.6B-shaped exporter and a 12-layer, 768-wide importer, bf16.
CONFIGS = {
    "tiny": {
        "exporter": ModelConfig(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, mlp=256, vocab=4096,
                                dtype="float32"),
        "importer": ModelConfig(hidden=96, layers=3, heads=4, kv_heads=2, head_dim=24, mlp=192, vocab=4096,
                                dtype="float32"),
    },
    "reference": {
        "exporter": ModelConfig(),
        "importer": ModelConfig(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, mlp=2048),
    },
    # two models of one shape with weights of their own (kvcached's case: several models of one size on a GPU)
    "twins": {"exporter": ModelConfig(), "importer": ModelConfig()},
}
MODELS = CONFIGS["tiny"]


class Turn:
    """The turn of the processes sharing graph memory: an exclusive ``flock`` on one file.

    Each process opens the file itself (a lock belongs to an open file, so
    two openers exclude each other). The kernel drops the lock when its
    holder exits or is killed, so a dead holder frees the turn.

    The device is asynchronous: a step's kernels may still run when the
    process that queued them is done with the step, and the other process's
    replay would then overwrite the shared bytes under them. With
    ``backend``, giving the turn back first waits for the device
    (``backend.synchronize()``), so a turn ends when this process's work on
    the device has ended, not when it was queued.
    """

    def __init__(self, path: str | os.PathLike[str], backend: hal.Backend | None = None) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.backend = backend

    def acquire(self) -> float:
        """Take the turn, waiting for the holder; return the seconds waited."""
        t0 = time.perf_counter()
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return time.perf_counter() - t0

    def release(self) -> None:
        """Give the turn back, once the device has run everything this process queued (with a backend)."""
        try:
            if self.backend is not None:
                self.backend.synchronize()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def cost(self, rounds: int = 2000) -> float:
        """Median seconds of taking and giving back the turn when nobody else holds it."""
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.acquire()
            self.release()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def close(self) -> None:
        os.close(self.fd)


def memfd_inodes() -> set[int]:
    """Inodes of the memfds this process holds (``fake``'s chunks): the physical memory it can reach."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                found.add(os.stat(f"/proc/self/fd/{name}").st_ino)
    return found


def warm_up(engine: Any, sizes: Sequence[int]) -> None:
    """Each size's step once, eagerly, on the capture stream, before the capture loop is measured -- the
    warm-up engines run before they capture (nano-vllm's ``warmup_model``, vLLM's profile run): kernels are
    loaded and library workspaces made here, so the capture loop's memory is what its graphs hold."""
    be = engine.backend
    be.synchronize()
    with be.use_stream(engine.capture_stream):
        for bs in sizes:
            engine.forward(**engine.static_inputs(bs))
    be.synchronize(engine.capture_stream)


def used(be: hal.Backend) -> int:
    release_cached_memory(be)
    be.synchronize()
    return be.mem_info().used


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2 + i % 3,), generator=gen).tolist() for i in range(n)]


def kv_bytes(engine: Any) -> int:
    """Device memory the engine's KV cache maps now (the elastic ranges; all of it for a static cache)."""
    if engine.kv == "elastic":
        return sum(buf.mapped_bytes for buf in engine.kv_buffers)
    return sum(t.nbytes for t in (*engine.k_cache, *engine.v_cache))


@contextlib.contextmanager
def kv_for(engine: Any, sequences: int, tokens: int, peaks: list[int] | None = None) -> Iterator[None]:
    """An elastic KV cache holds the blocks of ``sequences`` sequences of ``tokens`` tokens for the block, and
    only the scratch block afterwards: what one engine does not use now, the other may."""
    if engine.kv != "elastic":
        yield
        return
    engine.resize_kv(1 + sequences * math.ceil(tokens / engine.block_size))
    if peaks is not None:
        peaks.append(kv_bytes(engine))
    try:
        yield
    finally:
        engine.resize_kv(1)  # waits for the device before it unmaps (graphkit's elastic buffers do)


@torch.no_grad()
def decode(engine: Any, batch_prompts: Sequence[Sequence[int]], steps: int,
           around_step: Callable[[], contextlib.AbstractContextManager[Any]] | None,
           times: list[float] | None = None, kv_peaks: list[int] | None = None
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding as ``Engine.generate`` does it, each step inside ``around_step()`` (the turn; None: eager
    on the rows a graph would see, no turn). The logits are copied out inside the turn. An elastic KV cache
    maps the batch's blocks for the decoding and gives them back after it."""
    n, lengths = len(batch_prompts), [len(p) for p in batch_prompts]
    total = max(lengths) + steps
    with kv_for(engine, n, total, kv_peaks):
        return _decode(engine, batch_prompts, steps, around_step, times)


def _decode(engine: Any, batch_prompts: Sequence[Sequence[int]], steps: int,
            around_step: Callable[[], contextlib.AbstractContextManager[Any]] | None,
            times: list[float] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    n, lengths = len(batch_prompts), [len(p) for p in batch_prompts]
    seqs = [list(p) for p in batch_prompts]
    total = max(lengths) + steps
    tables = engine.block_tables_for(n, total)
    seen = []
    for t in range(total - 1):
        ids = torch.tensor([s[t] for s in seqs], device=engine.device)
        batch = engine.decode_batch(ids, torch.full((n,), t, device=engine.device), tables)
        if around_step is None:
            logits = engine.step(batch, replay=False).clone()
        else:
            with around_step():
                t0 = time.perf_counter()
                logits = engine.step(batch).clone()  # read before the other process may replay
                if times is not None:
                    times.append(time.perf_counter() - t0)
        seen.append(logits)
        for s, token, length in zip(seqs, logits.argmax(dim=-1).tolist(), lengths, strict=True):
            if t + 1 >= length:
                s.append(token)
    return [s[length:length + steps] for s, length in zip(seqs, lengths, strict=True)], seen


# -- one engine process ---------------------------------------------------------------------------


def engine_process(role: str, mode: str, paths: dict[str, str], options: dict[str, Any], results: Any,
                   barrier: Any, captured: Any) -> None:
    """One engine: capture, meet the other, decode taking turns, check against eager, report on ``results``."""
    logging.basicConfig(level=logging.WARNING, format=f"{role}: %(name)s: %(message)s")
    torch.set_num_threads(1)
    name = options["backend"]
    be = hal.get_backend(name, **BACKEND_OPTIONS.get(name, {}))
    try:
        results.put({"role": role, **_serve(be, role, mode, paths, options, results, barrier, captured)})
    except BaseException as exc:
        results.put({"role": role, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        be.close()


def _serve(be: hal.Backend, role: str, mode: str, paths: dict[str, str], options: dict[str, Any], results: Any,
           barrier: Any, captured: Any) -> dict[str, Any]:
    """One engine's life. The two processes build their engines side by side, then capture one at a time (the
    exporter first), so that the device's used memory, which both processes move on a GPU, measures one
    capture loop at a time."""
    sizes = list(options.get("sizes", CONFIG_SIZES[options.get("config", "tiny")]))
    models = CONFIGS[options.get("config", "tiny")]
    pools: graphkit.GraphPools | None = None
    imported: ImportedSpaces | None = None
    imported_inodes: list[int] | None = None
    listener = None
    if mode == "independent" or role == "exporter":
        pools = graphkit.GraphPools(be, outputs="replay")  # outputs are read right after their replay, in the turn
        if role == "exporter" and mode == "shared":
            if options.get("reserve_bytes"):
                pools.allocator.precreate(options["reserve_bytes"])  # room for an importer with larger graphs
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(paths["socket"])
            listener.listen(1)
    kv = options.get("kv", "elastic")
    engine = engine_decode.Engine(be, models[role], max_batch=max(sizes), max_model_len=MAX_MODEL_LEN,
                                  seed=ROLES.index(role) + 1, pools=pools, kv=kv,
                                  kv_max_blocks=max(sizes) * math.ceil(MAX_MODEL_LEN / 16) + 1
                                  if kv == "elastic" else None)
    turn = Turn(paths["turn"], be) if mode == "shared" else None
    try:
        barrier.wait(MEETING_TIMEOUT)  # both engines built (weights, caches): the captures follow, one at a time
        if role == "importer" and not captured.wait(MEETING_TIMEOUT):
            raise TimeoutError(f"the exporter did not capture within {MEETING_TIMEOUT:.0f} s")
        warm_up(engine, sizes)
        before = used(be)
        if role == "importer" and mode == "shared":
            held = memfd_inodes() if be.name == "fake" else set()
            imported = engine.pools = _receive(be, paths["socket"])
            imported_inodes = sorted(memfd_inodes() - held) if be.name == "fake" else None
        capture_s = engine.capture_graphs(sizes)
        created = used(be) - before
        if role == "exporter":
            captured.set()
        if listener is not None:
            _send(pools, listener)
        graph_bytes = pools.report().chunk_bytes if pools is not None else imported.size if imported else 0
        crash = role == "importer" and options.get("crash")
        if crash:
            assert turn is not None
            turn.acquire()  # before the exporter may decode: it waits for this turn
        barrier.wait(MEETING_TIMEOUT)  # both have captured: decode side by side from here
        if crash:
            _hold_and_wait(engine, results)  # never returns: killed while it holds the turn
        step_times: list[float] = []
        waits: list[float] = []

        def around() -> contextlib.AbstractContextManager[Any]:
            return _timed_turn(turn, waits) if turn is not None else contextlib.nullcontext()

        batch = prompts(options.get("seqs", 3), engine.cfg.vocab, seed=ROLES.index(role))
        kv_idle = kv_bytes(engine)
        kv_peaks: list[int] = []
        tokens, logits = decode(engine, batch, options.get("steps", 8), around, kv_peaks=kv_peaks)
        eager_tokens, eager_logits = decode(engine, batch, options.get("steps", 8), None)
        worst = max(float((a - b).abs().max()) for a, b in zip(logits, eager_logits, strict=True))
        one = prompts(1, engine.cfg.vocab, seed=7)
        decode(engine, one, options.get("timed_steps", 24), around, step_times)  # batch 1, timed
        return {"mode": mode, "tokens": tokens, "tokens_equal_eager": tokens == eager_tokens,
                "max_abs_error": worst, "created_bytes": created, "graph_bytes": graph_bytes,
                "imported_bytes": imported.size if imported is not None else 0,
                "outside_pools_bytes": created - (graph_bytes if pools is not None else 0),
                "chunk_inodes": sorted(memfd_inodes()) if be.name == "fake" else None,
                "imported_inodes": imported_inodes,
                "kv": engine.kv, "kv_idle_bytes": kv_idle, "kv_peak_bytes": max(kv_peaks, default=kv_idle),
                "kv_after_bytes": kv_bytes(engine), "capture_seconds": capture_s,
                "step_ms_batch1": 1e3 * statistics.median(step_times),
                "longest_wait_s": max(waits, default=0.0), "pid": os.getpid()}
    finally:
        engine.close()
        for closable in (imported, pools, turn, listener):
            if closable is not None:
                closable.close()


@contextlib.contextmanager
def _timed_turn(turn: Turn, waits: list[float]) -> Iterator[None]:
    waits.append(turn.acquire())
    try:
        yield
    finally:
        turn.release()


def _send(pools: graphkit.GraphPools | None, listener: socket.socket) -> None:
    """Export every chunk of the exporter's pools to the importer that connects."""
    assert pools is not None and pools.allocator is not None
    alloc = pools.allocator
    listener.settimeout(MEETING_TIMEOUT)
    conn, _ = listener.accept()
    with conn, export_handles(alloc.backend, alloc.chunks, alloc.granularity, 0,
                              len(alloc.chunks) * alloc.granularity) as exported:
        send_range(conn, exported)


def _receive(be: hal.Backend, path: str) -> ImportedSpaces:
    """Connect to the exporter (once it listens) and import its chunks."""
    deadline = time.monotonic() + MEETING_TIMEOUT
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.settimeout(MEETING_TIMEOUT)
    with sock:
        return receive_spaces(sock, be)


def _hold_and_wait(engine: Any, results: Any) -> None:
    """Holding the turn: replay a step (the shared bytes now hold this process's activations), say so, and
    wait to be killed."""
    if engine.kv == "elastic":
        engine.resize_kv(1 + 2 * math.ceil(engine.max_model_len / engine.block_size))
    engine.step(engine.example_batch(2))
    results.put({"role": "importer", "holding": True, "pid": os.getpid()})
    time.sleep(3600)


# -- the two processes ---------------------------------------------------------------------------


def run_pair(mode: str = "shared", backend: str = "fake", *, crash: bool = False, hold_s: float = 1.0,
             timeout: float = 600.0, **options: Any) -> dict[str, Any]:
    """Start the exporter and the importer (spawned), let them decode; their reports by role, and the turn's
    cost measured here once both are done. ``crash``: the importer takes the turn and is killed (SIGKILL)
    ``hold_s`` seconds later, while it holds it."""
    if mode not in MODES:
        raise hal.InvalidArgumentError(f"mode={mode!r} must be one of {MODES}", call="run_pair")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="graphkit-turns-") as tmp:
        paths = {"socket": os.path.join(tmp, "chunks.sock"), "turn": os.path.join(tmp, "turn.lock")}
        results, barrier, captured = ctx.Queue(), ctx.Barrier(2), ctx.Event()
        opts = {"backend": backend, "crash": crash, **options}
        procs = {role: ctx.Process(target=engine_process, args=(role, mode, paths, opts, results, barrier, captured),
                                   name=f"turns-{role}", daemon=True) for role in ROLES}
        for proc in procs.values():
            proc.start()
        out: dict[str, Any] = {"mode": mode, "crash": crash}
        deadline = time.monotonic() + timeout
        try:
            expected = {"exporter"} if crash else set(ROLES)
            while not expected <= set(out):
                message = results.get(timeout=max(1.0, deadline - time.monotonic()))
                if message.get("holding"):
                    time.sleep(hold_s)  # the exporter is waiting for the turn meanwhile
                    os.kill(message["pid"], signal.SIGKILL)
                    out["killed_holder"] = message["pid"]
                    continue
                out[message["role"]] = message
                if "error" in message:
                    break
        except queue.Empty:
            out["error"] = f"no report within {timeout:.0f} s"
        finally:
            for proc in procs.values():
                proc.join(timeout=30 if "error" not in out else 1)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            out["exitcodes"] = {role: proc.exitcode for role, proc in procs.items()}
        turn = Turn(paths["turn"])
        try:
            out["turn_ms"] = 1e3 * turn.cost()
        finally:
            turn.close()
    return out


def summary(shared: dict[str, Any], independent: dict[str, Any]) -> list[str]:
    """The figures side by side, and the issue's targets judged where they can be."""
    lines = []
    for run in (shared, independent):
        roles = [run[r] for r in ROLES if r in run]
        created = sum(r["created_bytes"] for r in roles)
        parts = ", ".join(f"{r['role']} {fmt_bytes(r['created_bytes'])}: {fmt_bytes(r['graph_bytes'])} of chunks"
                          f"{' (imported)' if r['imported_bytes'] else ''} + {fmt_bytes(r['outside_pools_bytes'])} "
                          "outside the pools" for r in roles)
        steps = ", ".join(f"{r['role']} {r['step_ms_batch1']:.3f} ms" for r in roles)
        lines.append(f"{run['mode']:>11}: graph memory created {fmt_bytes(created)} ({parts}); step at batch 1 "
                     f"{steps}; tokens equal eager: {all(r['tokens_equal_eager'] for r in roles)}")
    for run in (shared,):
        kv = ", ".join(f"{r} {fmt_bytes(run[r]['kv_idle_bytes'])} idle, {fmt_bytes(run[r]['kv_peak_bytes'])} "
                       f"decoding, {fmt_bytes(run[r]['kv_after_bytes'])} after" for r in ROLES)
        lines.append(f"{'KV caches':>11}: {shared[ROLES[0]]['kv']}: {kv}")
    both = sum(shared[r]["created_bytes"] for r in ROLES)
    apart = sum(independent[r]["created_bytes"] for r in ROLES)
    ratio = both / apart if apart else float("nan")
    lines.append(f"shared / independent graph memory: {ratio:.2f} (target <= 0.6): "
                 f"{'met' if ratio <= 0.6 else 'MISSED'}")
    step = min(shared[r]["step_ms_batch1"] for r in ROLES)
    overhead = shared["turn_ms"] / step
    lines.append(f"a turn (flock taken and given back) {shared['turn_ms'] * 1e3:.1f} us = {100 * overhead:.2f}% "
                 f"of the shorter step at batch 1 ({step:.3f} ms; target <= 5%): "
                 f"{'met' if overhead <= 0.05 else 'MISSED'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="fake", help="hal backend of both processes (needs memory_sharing)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--crash", action="store_true",
                        help="the importer dies (SIGKILL) holding the turn; the exporter must finish, exact")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="model sizes (default: tiny on fake, reference on a device)")
    parser.add_argument("--kv", choices=("elastic", "static"), default="elastic",
                        help="KV caches: elastic (each maps the blocks of the batch it decodes, then gives them "
                             "back) or static (allocated whole)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = args.config or ("tiny" if args.backend == "fake" else "reference")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.crash:
        run = run_pair("shared", args.backend, crash=True, steps=args.steps, config=config, kv=args.kv)
        print(json.dumps(run) if args.json else
              f"importer killed holding the turn; exporter waited {run['exporter']['longest_wait_s']:.2f} s, "
              f"then finished: tokens equal eager {run['exporter']['tokens_equal_eager']}")
        return 0 if run.get("exporter", {}).get("tokens_equal_eager") else 1
    shared = run_pair("shared", args.backend, steps=args.steps, config=config, kv=args.kv)
    independent = run_pair("independent", args.backend, steps=args.steps, config=config, kv=args.kv)
    failed = [run.get(r, {}).get("error") or run.get("error") for run in (shared, independent) for r in ROLES
              if "error" in run.get(r, {}) or "error" in run or r not in run]
    if failed:
        print(f"error: {failed}")
        return 2
    if args.json:
        print(json.dumps({"shared": shared, "independent": independent}))
    else:
        print("\n".join(summary(shared, independent)))
    ok = all(run[r]["tokens_equal_eager"] for run in (shared, independent) for r in ROLES)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
