"""FlashInfer's custom all-reduce (its vLLM-style kernel, built on the device by FlashInfer's JIT) in graphs over graphkit memory.

On the device, from the repository root (no network: FlashInfer travels in .whl-fi/, cut to its all-reduce by
``python tests/cuda_scripts/flashinfer_site.py FLASHINFER_WHEEL TVM_FFI_WHEEL --out .whl-fi`` here)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-fi/*.whl
    export PYTHONPATH=/tmp/site:$PWD/.whl-fi/site:$PWD
    timeout 300 python tests/cuda_scripts/flashinfer_allreduce.py --world 2 --out DIR --timeout 280
    timeout 300 python tests/cuda_scripts/flashinfer_allreduce.py --world 4 --out DIR --timeout 280
    timeout 300 python tests/cuda_scripts/flashinfer_allreduce.py --world 2 --serve --out DIR --timeout 280
    timeout 300 python tests/cuda_scripts/flashinfer_allreduce.py --world 2 --same-device --serve --kinds registered,staged --out DIR

``--serve``: graphkit serves FlashInfer's graph-buffer registration (``graphkit.graphs.allreduce.serve_flashinfer``,
called before the all-reduce is made; the pools over ``hal.get_backend("cuda", shareable=True)``), so the
``registered`` kind reads the graph's own buffers in place over graphkit memory. ``--same-device``: every rank on
GPU 0 (where one GPU is lent), a gloo process group for the reference all-reduce and no ``nccl`` kind; the ranks'
kernels take turns on the one GPU, so its latency figures say nothing of a kernel's speed.

The launcher starts ``--world`` rank processes of this script, each with a hard deadline (``tests/ranks.py``), and
writes DIR/flashinfer_allreduce.json (every rank's RESULT) and DIR/flashinfer_allreduce.md (one line for the
benchmark table). It prints ``RESULT {json}`` and exits 0 when every rank passed, 1 when one failed, and 3 with a
``SKIP reason`` line when FlashInfer is not importable or its JIT cannot build the all-reduce module.

FlashInfer's JIT writes under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``; this script points it (and
``TVM_FFI_CACHE_DIR``) at ``--jit-dir`` (default /tmp/graphkit-flashinfer) before FlashInfer is first imported, and
sets ``CUDA_HOME`` to /usr/local/cuda where it is unset and that folder has nvcc. Every rank builds (or loads) the
module before the process group is up, so a failed build ends every rank with the SKIP line rather than a hang.

Each rank, on its own GPU, with torch.distributed (NCCL) up:

* makes the all-reduce's state as FlashInfer's documentation and tests do: ``create_shared_buffer`` (its own
  ``cudaMalloc`` + legacy CUDA IPC, outside any graph) for the signal buffer (``vllm_meta_size() + MAX_BYTES``) and
  for a staging buffer (``MAX_BYTES``), a ``rank_data`` tensor, ``vllm_init_custom_ar`` and ``vllm_register_buffer``;
* captures one graph per (kind, size): ``h = x * (rank + 1)``, ``r = all_reduce(h)``, ``out = r + x``, once in
  torch's own graph pool and once inside ``graphkit.graph_memory()`` (a ``MemorySaver`` attached). Kinds:

  - ``registered``: the kernel reads ``h`` itself, on every rank. After capture, FlashInfer's
    ``vllm_get_graph_buffer_ipc_meta`` calls ``cudaIpcGetMemHandle`` on the base of each captured input (the graph's
    own buffers: graphkit's memory inside the scope) and ``vllm_register_graph_buffers`` opens the peers' handles:
    the path vLLM and SGLang take in graphs, the one that needs legacy IPC on graph memory;
  - ``staged``: ``h`` is first copied into FlashInfer's staging buffer, which is what the peers read (the
    registration after capture covers only FlashInfer's own buffer);
  - ``nccl``: NCCL in the graph, the reference for latency;

* checks every replay against NCCL's all-reduce run eagerly (bf16 small integers: the sums are exact, so "equal"
  is ``torch.equal``): replays in a shuffled order, each checked right after it; all keys replayed, then every
  output checked (each kept its own result over the shared chunks); after ``MemorySaver.pause()`` and ``resume()``,
  the same again;
* measures replay latency of each (kind, size) over graphkit memory against the same graph in torch's own pool,
  interleaved (the order of the two alternates per repetition): median, minimum and maximum over ``--reps``.

Where the registration of a kind's graphkit graphs is refused (without ``--serve``: ``cudaIpcGetMemHandle`` on
memory that legacy IPC does not serve), the rank records the error under ``refused``, drops that kind's graphkit
graphs, goes on with the others and fails at the end.
"""  # noqa: E501 (the device commands above, one line each)

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script, also where this one is imported
from custom_allreduce import compare  # noqa: E402  (the latency statistics both scripts report)

#: elements (bf16) per all-reduce: 8 KiB, 128 KiB, 1 MiB (the last takes the two-stage kernel on 4 ranks)
SIZES = (4096, 65536, 524288)
KINDS = ("registered", "staged", "nccl")
#: the kinds that are FlashInfer's kernel, not NCCL
CUSTOM = ("registered", "staged")
#: bytes of the staging buffer and of the signal buffer's scratch (FlashInfer's tests use 8 MiB)
MAX_BYTES = 8 * 1024 * 1024
#: the kernel's largest grid (``kMaxBlocks`` in FlashInfer's header)
NUM_CTAS = 36
#: exit status of a rank, and of the launcher, when FlashInfer cannot be used here
SKIP = 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks, one GPU each (2, 4, 6 or 8)")
    parser.add_argument("--rank", type=int, default=None, help="run as this rank (the launcher sets it)")
    parser.add_argument("--out", type=Path, default=None, help="folder for flashinfer_allreduce.json and .md")
    parser.add_argument("--timeout", type=float, default=280.0, help="seconds before every rank is killed")
    parser.add_argument("--reps", type=int, default=7, help="interleaved latency repetitions")
    parser.add_argument("--iters", type=int, default=50, help="replays per timed repetition")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bf16 elements per all-reduce")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)}")
    parser.add_argument("--serve", action="store_true",
                        help="graphkit serves FlashInfer's graph-buffer registration (graphkit.graphs.allreduce."
                             "serve_flashinfer, over a shareable backend): the registered kind reads in place")
    parser.add_argument("--switch-serves", action="store_true",
                        help="the ranks start with GRAPHKIT_GRAPH_MEMORY=allreduce=flashinfer and make no call of "
                             "their own: the switch serves FlashInfer's registration from its import on (and the "
                             "captures outside the script's block: give --kinds registered)")
    parser.add_argument("--executables", choices=("lazy", "off"), default="lazy",
                        help="the graphkit pools' executables budget: lazy (the default: graphkit launches each "
                             "replay) or off (the framework instantiates and replays its graphs itself)")
    parser.add_argument("--same-device", action="store_true",
                        help="every rank on GPU 0 (where one GPU is lent): a gloo process group, no nccl kind; "
                             "the ranks' kernels take turns on the GPU, so latency is not judged")
    parser.add_argument("--jit-dir", type=Path, default=Path("/tmp/graphkit-flashinfer"),
                        help="FLASHINFER_WORKSPACE_BASE: where FlashInfer's JIT builds and caches its modules")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    args.kinds = [k for k in str(args.kinds).split(",") if k]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        parser.error(f"--kinds: unknown {bad}; choose from {KINDS}")
    if args.switch_serves and (args.serve or args.kinds != ["registered"]):
        parser.error("--switch-serves: the switch serves instead of --serve, and its pools take the captures outside "
                     "the script's block too, where a staged or nccl kind would mix memories: give --kinds registered")
    if args.same_device and "nccl" in args.kinds:
        parser.error("--same-device: NCCL refuses two ranks on one GPU; leave the nccl kind out")
    if args.world < 2 or args.world > 8 or args.world % 2:
        parser.error("--world must be 2, 4, 6 or 8 (FlashInfer's kernel takes an even number of ranks up to 8)")
    if not args.sizes or any(n <= 0 or n % (8 * args.world) or 2 * n > MAX_BYTES for n in args.sizes):
        parser.error(f"--sizes: each a positive number of bf16 elements, a multiple of {8 * args.world}, "
                     f"at most {MAX_BYTES // 2}")
    if args.reps < 1 or args.iters < 1:
        parser.error("--reps and --iters must be at least 1")
    if args.rank is not None and not 0 <= args.rank < args.world:
        parser.error(f"--rank {args.rank} outside 0..{args.world - 1}")
    return args


def jit_env(jit_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables FlashInfer's JIT reads, set where unset: its cache under ``jit_dir``, the CUDA toolkit."""
    environ = dict(os.environ if environ is None else environ)
    environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(jit_dir))
    environ.setdefault("TVM_FFI_CACHE_DIR", str(jit_dir / "tvm-ffi"))  # only used by a torch without DLPack's C API
    if "CUDA_HOME" not in environ and Path("/usr/local/cuda/bin/nvcc").exists():
        environ["CUDA_HOME"] = "/usr/local/cuda"
    return environ


def markdown_line(summary: dict[str, Any]) -> str:
    """One line for the benchmark table: ranks, device, kinds, the worst and median latency ratio, correctness."""
    ratios = [(kind, size, row["ratio"]) for kind, per_size in summary["latency"].items() if kind in CUSTOM
              for size, row in per_size.items()]
    worst = max(ratios, key=lambda r: r[2]) if ratios else None
    median = statistics.median(r[2] for r in ratios) if ratios else float("nan")
    checks = "equal to NCCL after aliasing replays and a sleep" if summary["ok"] else "FAILED (see the JSON)"
    kinds = ", ".join(k for k in summary["kinds_run"] if k in CUSTOM) or "none"
    worst_text = f"{worst[2]:.3f}x ({worst[0]}, {int(worst[1]) * 2 // 1024} KiB)" if worst else "n/a"
    return (f"| FlashInfer custom all-reduce in graphs, {summary['world']} ranks, {summary.get('device', '?')} | "
            f"flashinfer {summary.get('flashinfer', '?')} vllm_ar {kinds} | graphkit/plain replay latency: "
            f"median {median:.3f}x, worst {worst_text} | {checks} | `{summary['command']}` |")


# -- one rank -------------------------------------------------------------------------------------------------


class Skip(Exception):
    """FlashInfer cannot be used on this machine: not importable, or its JIT failed."""


def legacy_ipc_capable(ptr: int) -> int | None:
    """The driver's ``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`` at ``ptr`` (None without cuda-bindings)."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        return None
    err, capable = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                           ptr)
    return int(capable) if int(err) == 0 else None


def clear_last_error(comm: Any) -> None:
    """Reset the last error of the CUDA runtime loaded in this process (the one torch and FlashInfer's module
    share): a refused ``cudaIpcGetMemHandle`` leaves it set, and torch's next launch check would report it."""
    lib = comm.CudaRTLibrary().lib  # FlashInfer's handle on the runtime found in this process's maps
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaGetLastError()


def load_flashinfer(args: argparse.Namespace, result: dict[str, Any]) -> Any:
    """``flashinfer.comm`` with its all-reduce module built (or loaded from the cache); :class:`Skip` if not."""
    os.environ.update(jit_env(args.jit_dir))  # before FlashInfer's first import: it reads them at import
    result["jit_env"] = {k: os.environ.get(k) for k in ("FLASHINFER_WORKSPACE_BASE", "TVM_FFI_CACHE_DIR",
                                                        "CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST")}
    import torch

    # FlashInfer's calls take torch's current stream (the capture stream) through this; without it they run on
    # the default stream and cannot be captured
    result["torch_dlpack_c_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    try:
        flashinfer = importlib.import_module("flashinfer")
        comm = importlib.import_module("flashinfer.comm")
        vllm_ar = importlib.import_module("flashinfer.comm.vllm_ar")
    except Exception as exc:  # ImportError, or a dependency failing at import
        raise Skip(f"flashinfer is not importable: {type(exc).__name__}: {exc}") from exc
    result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    started = time.perf_counter()
    try:
        spec = comm.gen_vllm_comm_module()
        result["jit_cached"] = bool(spec.is_compiled)
        vllm_ar.get_vllm_comm_module()  # builds with ninja + nvcc unless cached, then loads
    except Exception as exc:
        raise Skip(f"flashinfer's JIT could not build vllm_comm: {type(exc).__name__}: {exc}") from exc
    result["jit_seconds"] = time.perf_counter() - started
    print(f"rank {args.rank}: flashinfer {result['flashinfer']} vllm_comm ready in {result['jit_seconds']:.1f} s "
          f"(cached before: {result['jit_cached']})", file=sys.stderr, flush=True)
    return comm


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    rank, world = args.rank, args.world
    result: dict[str, Any] = {"rank": rank, "world": world, "served": args.serve or args.switch_serves,
                              "served_by": "switch" if args.switch_serves else "call" if args.serve else None,
                              "same_device": args.same_device}
    gpus = 1 if args.same_device else world
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        raise Skip(f"{world} ranks need {gpus} GPU(s); torch sees {torch.cuda.device_count()}")
    index = 0 if args.same_device else rank
    torch.cuda.set_device(index)
    comm = load_flashinfer(args, result)

    import torch.distributed as dist

    import graphkit
    import hal
    from graphkit.graphs import allreduce

    device = torch.device("cuda", index)
    if args.same_device:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    result |= {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "device": torch.cuda.get_device_name(index)}
    # before FlashInfer's all-reduce is made: graphkit follows its books from the first call
    serving = allreduce.serve_flashinfer(timeout=min(60.0, args.timeout / 2)) if args.serve else None

    # FlashInfer's state, made as its documentation says: its own buffers, outside any graph and any scope
    meta_ptrs = comm.create_shared_buffer(comm.vllm_meta_size() + MAX_BYTES, group=group)
    staging_ptrs = comm.create_shared_buffer(MAX_BYTES, group=group)
    rank_data = torch.empty(8 * 1024 * 1024, dtype=torch.uint8, device=device)
    fa = comm.vllm_init_custom_ar(meta_ptrs, rank_data, rank, True)
    comm.vllm_register_buffer(fa, staging_ptrs)
    staging = int(staging_ptrs[rank])
    kinds = list(args.kinds)
    result["kinds_run"] = kinds

    def all_reduce(kind: str, h: torch.Tensor) -> torch.Tensor:
        if kind == "nccl":
            r = h.clone()
            dist.all_reduce(r)
            return r
        out = torch.empty_like(h)
        capturing = torch.cuda.is_current_stream_capturing()
        # eagerly the kernel reads only registered buffers: the staging one
        direct = kind == "registered" and capturing
        comm.vllm_all_reduce(fa, h, out, 0 if direct else staging, 0 if direct else MAX_BYTES, NUM_CTAS)
        return out

    def expected(x: torch.Tensor) -> torch.Tensor:
        ref = x * (rank + 1)
        dist.all_reduce(ref)  # NCCL, eager
        return ref + x

    def register_captured(where: str) -> str | None:
        """Exchange and open the buffers the captures since the last call read (FlashInfer's graph registration);
        every rank registers or none does. The error text where a rank could not export its buffers."""
        try:
            handles, offsets = comm.vllm_get_graph_buffer_ipc_meta(fa)
            mine: tuple[Any, Any] | str = (list(handles), list(offsets))
        except Exception as exc:  # noqa: BLE001 (any failure must reach the peers, or they wait in the gather)
            mine = f"{where}: {type(exc).__name__}: {exc}"
            clear_last_error(comm)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        refused = [f"rank {r}: {e}" for r, e in enumerate(everyone) if isinstance(e, str)]
        if refused:
            return "; ".join(refused)
        comm.vllm_register_graph_buffers(fa, [e[0] for e in everyone], [e[1] for e in everyone])
        return None

    keys = [(kind, n) for n in args.sizes for kind in kinds]
    inputs = {key: torch.zeros(key[1], dtype=torch.bfloat16, device=device) for key in keys}  # static, outside
    feeds = [0]

    def feed(key: tuple[str, int]) -> None:
        feeds[0] += 1
        gen = torch.Generator().manual_seed(7919 * feeds[0] + rank)
        inputs[key].copy_(torch.randint(-8, 9, (key[1],), generator=gen).to(torch.bfloat16))

    def step(kind: str, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(kind, x * (rank + 1)) + x

    # warm-up and eager correctness, outside any capture
    for key in keys:
        feed(key)
        if not torch.equal(step(key[0], inputs[key]), expected(inputs[key])):
            raise AssertionError(f"rank {rank}: eager {key} differs from NCCL's all-reduce")
    torch.cuda.synchronize()

    # the same graphs in torch's own graph pool, for latency, captured outside the scope; then registered
    plain: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    for key in keys:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(key[0], inputs[key])
        plain[key] = (graph, out)
    refused: dict[str, str] = {}
    error = register_captured("torch's graph pool")
    if error:
        raise RuntimeError(f"rank {rank}: FlashInfer's graph registration failed on torch's own pool: {error}")

    if args.switch_serves:  # what the switch did in this process, from its start
        namespace = importlib.import_module("flashinfer.comm.vllm_ar").get_vllm_comm_module()
        result["namespace_served"] = isinstance(getattr(namespace.all_reduce, "__self__", None),
                                                allreduce.ServedAllReduce)
    be = hal.get_backend("cuda", device=index, shareable=args.serve or args.switch_serves)  # chunks a peer can map
    saver = graphkit.MemorySaver(be)
    pools = graphkit.GraphPools(be, saver=saver, executables=None if args.executables == "off" else "lazy")
    result["executables"] = args.executables
    graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    in_graph: dict[str, list[int]] = {kind: [] for kind in kinds}
    graphkit_held: dict[str, bool] = {}  # per kind: every ``h`` of its captures lies in a graphkit space
    capable: dict[str, list[int | None]] = {}  # per kind: the driver's legacy-IPC attribute of its ``h``
    # one batch per kind, each registered right after its captures: a refused kind leaves the others usable
    for kind in [k for k in ("staged", "nccl", "registered") if k in kinds]:
        with graphkit.graph_memory(pools=pools):
            for key in [k for k in keys if k[0] == kind]:  # ascending sizes
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    h = inputs[key] * (rank + 1)
                    out = all_reduce(kind, h) + inputs[key]
                in_graph[kind].append(h.data_ptr())
                graphs[key] = (graph, out)
                del h
        spaces = [(s.base, s.size) for s in pools.allocator.spaces.values()] if pools.allocator else []
        graphkit_held[kind] = all(any(base <= p < base + size for base, size in spaces) for p in in_graph[kind])
        capable[kind] = sorted({legacy_ipc_capable(p) for p in in_graph[kind]}, key=str)
        error = register_captured(f"graphkit memory, kind {kind}") if kind in CUSTOM else None
        if error:
            refused[kind] = error
            for key in [k for k in keys if k[0] == kind]:
                graphs.pop(key)[0].reset()
    result["refused"] = refused
    live = [key for key in keys if key in graphs]
    spaces = [(s.base, s.size) for s in pools.allocator.spaces.values()] if pools.allocator else []
    result["graph_memory_is_graphkit"] = graphkit_held
    result["plain_memory_is_graphkit"] = any(base <= out.data_ptr() < base + size for _, out in plain.values()
                                             for base, size in spaces)
    result["legacy_ipc_capable_graph_buffers"] = capable
    result["legacy_ipc_capable_plain_buffers"] = sorted({legacy_ipc_capable(out.data_ptr())
                                                         for _, out in plain.values()}, key=str)
    report = pools.report()
    result["pools_report"] = str(report).splitlines()[0] if str(report) else ""
    checks: dict[str, int] = {}

    def check_each(phase: str) -> None:
        order = list(live)
        random.Random(phase).shuffle(order)  # the same order on every rank: the collectives pair up
        for key in order:
            graph, out = graphs[key]
            feed(key)
            graph.replay()
            want = expected(inputs[key])
            if not torch.equal(out, want):
                raise AssertionError(f"rank {rank}, {phase}: graph {key} differs from NCCL's all-reduce: "
                                     f"{int((out != want).sum())} of {out.numel()} elements")
        torch.cuda.synchronize()
        checks[phase] = len(order)

    def check_kept(phase: str) -> None:
        wants = {}
        for key in live:  # every key replays over the chunks of the ones before it
            feed(key)
            wants[key] = inputs[key].clone()
            graphs[key][0].replay()
        for key in live:
            if not torch.equal(graphs[key][1], expected(wants[key])):
                raise AssertionError(f"rank {rank}, {phase}: graph {key}'s output did not keep its result")
        torch.cuda.synchronize()
        checks[phase] = len(live)

    check_each("replays, shuffled")
    check_kept("all replayed, then read")
    dist.barrier()  # no peer still reads this rank's graph memory
    saver.pause()
    saver.resume()
    dist.barrier()
    check_each("after sleep and resume, shuffled")
    check_kept("after sleep and resume, all replayed, then read")
    result["checks"] = checks

    def timed(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # not timed: settles the peers
        start.record()
        for _ in range(args.iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / args.iters

    samples: dict[tuple[str, int], dict[str, list[float]]] = {key: {"graphkit": [], "plain": []} for key in live}
    for rep in range(args.reps):
        order: list[tuple[str, dict]] = [("graphkit", graphs), ("plain", plain)]
        if rep % 2:
            order.reverse()
        for key in live:
            for mode, table in order:
                samples[key][mode].append(timed(table[key][0]))
    result["latency"] = {kind: {str(n): compare(samples[(kind, n)]["graphkit"], samples[(kind, n)]["plain"])
                                for (k, n) in live if k == kind} for kind in kinds}

    torch.cuda.synchronize()
    for graph, _ in list(graphs.values()) + list(plain.values()):
        graph.reset()
    graphs.clear()
    plain.clear()
    del graph, out
    gc.collect()
    dist.barrier()
    comm.vllm_dispose(fa)  # closes this rank's mappings of the peers' buffers
    if serving is not None:
        serving.close()  # and graphkit's of the peers' graph memory (after the device's queued work)
    dist.barrier()  # every peer closed its mappings of this rank's graph memory before the chunks go
    pools.close()
    saver.close()
    comm.free_shared_buffer(staging_ptrs, group)
    comm.free_shared_buffer(meta_ptrs, group)
    dist.barrier()
    dist.destroy_process_group()
    result["refused"] = refused  # the other kinds' figures are kept; the rank still fails
    return result


def rank_main(args: argparse.Namespace) -> int:
    try:
        result = run_rank(args)
    except Skip as exc:
        print(f"SKIP {exc}", flush=True)
        return SKIP
    print("RESULT", json.dumps(result), flush=True)
    return 1 if result.get("refused") else 0


# -- the launcher -----------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: Sequence[str], runner: Callable[..., list] | None = None) -> int:
    """Run every rank with a deadline; write the JSON and the markdown line; 0 when every rank passed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.ranks import explain, rank_env, run_ranks

    runner = runner or run_ranks
    env = jit_env(args.jit_dir, rank_env())
    if args.switch_serves:
        env["GRAPHKIT_GRAPH_MEMORY"] = "allreduce=flashinfer"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # graphkit from this tree
    started = time.monotonic()
    results = runner(Path(__file__), args.world, timeout=args.timeout, env=env,
                     args=["--rank-from-argv", *argv])
    skips = [line for r in results for line in r.output.splitlines() if line.startswith("SKIP ")]
    if skips and all(r.returncode == SKIP for r in results):
        print(skips[0], flush=True)
        return SKIP
    ranks: list[dict] = []
    for r in results:
        line = next((x for x in r.output.splitlines() if x.startswith("RESULT ")), None)
        ranks.append(json.loads(line[len("RESULT "):]) if line else
                     {"rank": r.rank, "failed": r.returncode, "output": r.output[-4000:]})
    ok = all(r.ok for r in results) and all("failed" not in x and not x.get("refused") for x in ranks)
    first = ranks[0] if ranks and "failed" not in ranks[0] else {}
    command = f"python tests/cuda_scripts/flashinfer_allreduce.py {' '.join(argv)}"
    summary = {"ok": ok, "world": args.world, "device": first.get("device"), "flashinfer": first.get("flashinfer"),
               "jit_seconds": [x.get("jit_seconds") for x in ranks], "seconds": time.monotonic() - started,
               "kinds_run": first.get("kinds_run", []), "latency": first.get("latency", {}), "command": command,
               "refused": first.get("refused", {})}
    line = markdown_line(summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flashinfer_allreduce.json").write_text(json.dumps({"summary": summary, "ranks": ranks},
                                                                       indent=1))
        (args.out / "flashinfer_allreduce.md").write_text(line + "\n")
    if not ok:
        print(explain(results), file=sys.stderr)
    print("RESULT", json.dumps({k: v for k, v in summary.items() if k != "latency"}
                               | {"markdown": line, "ratios": {k: {n: round(row["ratio"], 4) for n, row in v.items()}
                                                               for k, v in summary["latency"].items()}}), flush=True)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] and argv[1:2] == ["--rank-from-argv"]:  # a rank: ``RANK --rank-from-argv ARGS...`` (run_ranks)
        rank, rest = argv[0], argv[2:]
        return rank_main(parse_args([*rest, "--rank", rank]))
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
