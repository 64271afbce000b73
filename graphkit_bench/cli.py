"""``python -m graphkit demo`` and ``python -m graphkit bench``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import hal
from graphkit_bench import verifier
from graphkit_bench.engines import ENGINE_SIZES, ENGINE_STRATEGIES, WORKLOADS, run_engine_bench
from graphkit_bench.helptext import OneDefaultFormatter
from graphkit_bench.model import DecoderConfig
from graphkit_bench.strategies import COMPILE, EVERY_SIZE, ORDERS, STRATEGIES
from hal.types import fmt_bytes

if TYPE_CHECKING:
    from graphkit_bench.run import BenchConfig

DEMO_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
#: fake's granule for the tiny decoder (the demo's, and ``bench --workload tiny``'s): its largest size takes about
#: 40 of them, as a real model's graphs take tens of a GPU's 2 MiB granules; fake's own 2 MiB would hold the whole
#: tiny graph in one granule and every strategy but a pool per graph would show the same figure
TINY_FAKE_GRANULARITY = 16 << 10
#: the demo's capture orders: largest first (where one shared pool does best), smallest first, and sizes
#: captured when a batch first needs them, in a random order (as an engine that captures lazily at run time)
DEMO_ORDERS = ["descending", "ascending", "on-demand"]
SEED_LIMIT = 1 << 63  # torch generators take seeds below 2**64; the engine runs add the run index
#: the parts of an isolated decoder bench besides its strategies: the driver's memory per graph, the largest alone,
#: the every-size row
PARTS = ("graph-floor", "largest-alone", EVERY_SIZE)
DECODER_FLAGS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab", "context")


class CliParser(argparse.ArgumentParser):
    """argparse with every error as one line on stderr, exit code 2 (no usage block, no traceback)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Exit with code 2 and ``prog: error: message`` as the one line on stderr."""
    CliParser(prog=prog, add_help=False).error(message)


#: the most sizes one flag may name (a range of billions would only exhaust memory)
MAX_SIZES = 4096
#: batch sizes are below this (GraphRunner's limit)
BATCH_LIMIT = 1 << 31
#: tag and regrowth sizes in MiB are below this (a pebibyte)
MIB_LIMIT = 1 << 30


def parse_size_list(text: str, high: int = BATCH_LIMIT) -> list[int]:
    """``"1,2,4,8:257:8"``: commas separate items; ``a:b:c`` is ``range(a, b, c)``; each size in ``[1, high)``.

    At most :data:`MAX_SIZES` sizes, counted before any is made.
    """
    sizes: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            bounds = [int(x) for x in part.split(":")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"element {part!r} is not an int or a range a:b[:c]") from None
        if ":" in part:
            if len(bounds) not in (2, 3):
                raise argparse.ArgumentTypeError(f"element {part!r}: a range is a:b or a:b:c")
            if len(bounds) == 3 and bounds[2] == 0:
                raise argparse.ArgumentTypeError(f"element {part!r}: the step of a range must not be 0")
            r = range(*bounds)
            if not r:
                raise argparse.ArgumentTypeError(f"element {part!r} is an empty range")
            low, top = min(r[0], r[-1]), max(r[0], r[-1])
            if low < 1:
                raise argparse.ArgumentTypeError(f"element {part!r}: sizes must be >= 1 (got {low})")
            if top >= high:
                raise argparse.ArgumentTypeError(f"element {part!r}: sizes must be < {high} (got {top})")
            if len(sizes) + len(r) > MAX_SIZES:
                raise argparse.ArgumentTypeError(f"element {part!r} names {len(r)} sizes: at most {MAX_SIZES} "
                                                 "in all")
            sizes.update(r)
        else:
            if bounds[0] < 1:
                raise argparse.ArgumentTypeError(f"element {part!r}: sizes must be >= 1 (got {bounds[0]})")
            if bounds[0] >= high:
                raise argparse.ArgumentTypeError(f"element {part!r}: sizes must be < {high} (got {bounds[0]})")
            if len(sizes) >= MAX_SIZES:
                raise argparse.ArgumentTypeError(f"more than {MAX_SIZES} sizes")
            sizes.add(bounds[0])
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r} names no size")
    return sorted(sizes)


def parse_sizes(text: str) -> list[int]:
    """Batch sizes: :func:`parse_size_list` below 2**31."""
    return parse_size_list(text, BATCH_LIMIT)


def parse_mib_sizes(text: str) -> list[int]:
    """Sizes in MiB: :func:`parse_size_list` below a pebibyte."""
    return parse_size_list(text, MIB_LIMIT)


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int with ``low <= value`` (and ``value < high`` when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
        if high is not None and value >= high:
            raise argparse.ArgumentTypeError(f"must be < {high} (got {value})")
        return value
    parse.__name__ = "int"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a float > 0 (``inf`` allowed, ``nan`` not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def _names(allowed: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(bad)} (choose from {', '.join(allowed)})")
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names none (choose from {', '.join(allowed)})")
        return names
    return parse


def _add_demo_command(sub: Any) -> None:
    """The ``demo`` command and its options."""
    demo = sub.add_parser("demo", help="every memory strategy side by side on a small decoder (a minute on a CPU)",
                          formatter_class=OneDefaultFormatter)
    demo.add_argument("--out-dir", type=Path, default=Path("graphkit-demo"),
                      help="where demo.json and demo.png go (default: ./graphkit-demo)")
    demo.add_argument("--backend", help="hal backend (default: the best available; fake on a CPU)")


def _add_workload_options(bench: argparse.ArgumentParser) -> None:
    """``bench``: what it measures (the decoder's shape, or an engine's own loop)."""
    ref, tiny = DecoderConfig(), DecoderConfig.tiny()
    w = bench.add_argument_group("workload (defaults: the reference Qwen3-0.6B-shaped decoder)")
    w.add_argument("--workload", choices=["reference", "tiny", "engine", "hf"], default="reference",
                   help="the reference decoder or a tiny one (the options below override), or an engine's own "
                        "capture loop: 'engine' (examples/engine-decode) or 'hf' (a transformers Qwen3 model)")
    w.add_argument("--engine-config", choices=["reference", "tiny"], default="reference",
                   help="model size of the engine and hf workloads")
    w.add_argument("--runs", type=int_in(1), default=3,
                   help="engine and hf workloads: runs per case (fresh processes on devices); the median is shown")
    for name in DECODER_FLAGS:
        w.add_argument(f"--{name.replace('_', '-')}", type=int_in(1), default=None,
                       help=f"decoder {name.replace('_', ' ')} (default: the workload's; reference "
                            f"{getattr(ref, name)}, tiny {getattr(tiny, name)})")
    w.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help=f"weights and activations (default: the workload's; reference {ref.dtype}, tiny "
                        f"{tiny.dtype})")


def _add_run_options(bench: argparse.ArgumentParser) -> None:
    """``bench``: sizes, strategies, orders, backend and how each run is made."""
    bench.add_argument("--sizes", type=parse_sizes, default=None,
                       help="batch sizes, e.g. '1,2,4,8:257:8' (a:b:c = range(a, b, c)); default: "
                            f"1,2,4,8:257:8 for the reference decoder, {','.join(map(str, DEMO_SIZES))} for tiny, "
                            f"{','.join(map(str, ENGINE_SIZES))} for engine and hf (1,2,4,8 for --kv-sizing with "
                            "--engine-config tiny)")
    bench.add_argument("--strategies", type=_names([*STRATEGIES, COMPILE, *ENGINE_STRATEGIES]), default=None,
                       help=f"comma-separated strategies (decoder: {', '.join([*STRATEGIES, COMPILE])}; "
                            f"engine and hf: {', '.join(ENGINE_STRATEGIES)}); default: all of the workload's")
    bench.add_argument("--orders", type=_names(list(ORDERS)), default=list(ORDERS),
                       help="comma-separated capture orders")
    bench.add_argument("--every-size", action="store_true",
                       help="add a vmm row that captures every batch size 1..the largest (256 graphs for the "
                            "reference), largest first, next to the row of --sizes; judged: it costs <= 1.1 x")
    bench.add_argument("--backend", help="hal backend (default: the best available; fake on a CPU, with "
                                         f"{fmt_bytes(TINY_FAKE_GRANULARITY)} granules for the tiny decoder)")
    bench.add_argument("--device", type=int_in(0), default=0, help="device index")
    bench.add_argument("--iters", type=int_in(1), default=50, help="timed calls per figure")
    bench.add_argument("--compile-budget", type=positive_float, default=180.0,
                       help="seconds torch.compile may take before it is left out")
    bench.add_argument("--seed", type=int_in(0, SEED_LIMIT), default=0,
                       help="seed for weights, inputs and random orders")
    bench.add_argument("--out-dir", type=Path, default=Path("bench-out"), help="where bench.json and bench.png go")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--verify", action="store_true",
                       help="turn graphkit's optional isolation verifier on (its cost shows in the verify column)")
    bench.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto",
                       help="measure each strategy in a fresh process (auto: on devices other than the CPU), "
                            "so that nothing one strategy cached or leaked counts against another")


#: the bench's other modes: flag -> (the title of its option group, what the flag measures)
_MODES = {
    "--sleep": ("sleep and wake (--sleep: MemorySaver against torch_memory_saver)",
                ("measure pause and resume instead of graphs: 1, 4 and 16 GiB on a device (16 and 64 MiB on a CPU), "
                 "without and with backup, next to torch_memory_saver where installed")),
    "--elastic": ("elastic buffers (--elastic: growth in place against a bare map and allocate-and-copy)",
                  ("measure elastic buffers instead of graphs: single-granule grow latency from the free list and "
                   "with fresh chunks against a bare map, allocate-and-copy regrowth at 1, 4 and 16 GiB on a device "
                   "(16 and 64 MiB on a CPU), physical against used bytes as it grows")),
    "--kv-sizing": ("KV cache sizing (--kv-sizing: sized after capture against a pre-capture estimate)",
                    ("the engine of examples/engine-decode with an elastic KV cache, sized from the memory left "
                     "after capture and from the memory before capture less an estimate, alternating (--runs each, "
                     "fresh processes on a device): KV bytes, OOM at capture, memory left")),
}


def _add_sleep_options(sleep: argparse._ArgumentGroup) -> None:
    sleep.add_argument("--sleep-sizes", type=parse_mib_sizes, default=None,
                       help="tag sizes in MiB for --sleep, e.g. '1024,4096' (default: 1024,4096,16384 on a device, "
                            "16,64 on a CPU)")
    sleep.add_argument("--cycles", type=int_in(1), default=5,
                       help="pause/resume cycles per case (the median is shown)")
    sleep.add_argument("--rounds", type=int_in(1), default=None,
                       help="--sleep: rounds per size, graphkit and torch_memory_saver alternating, each a fresh "
                            "tag; --elastic: alternations of allocate-and-copy and elastic growth per size (default: "
                            "3 for --sleep, 5 for --elastic)")


def _add_elastic_options(elastic: argparse._ArgumentGroup) -> None:
    elastic.add_argument("--elastic-sizes", type=parse_mib_sizes, default=None,
                         help="regrowth sizes in MiB for --elastic, e.g. '1024,4096' (default: 1024,4096,16384 on a "
                              "device, 16,64 on a CPU)")


def _add_kv_sizing_options(kv: argparse._ArgumentGroup) -> None:
    kv.add_argument("--kv-margin-mib", type=int_in(0), default=None,
                    help="--kv-sizing: device memory both approaches leave alone (default: 1024 on a device, 1 on "
                         "fake)")
    kv.add_argument("--kv-estimate-mib", type=int_in(0), default=None,
                    help="--kv-sizing: the graph memory estimate (default: the peak of an eager step at the largest "
                         "batch, the profile engines make)")


def _add_mode_options(bench: argparse.ArgumentParser) -> None:
    """``bench --sleep``, ``--elastic`` and ``--kv-sizing``: a group each, with the flag and the mode's options."""
    more = {"--sleep": _add_sleep_options, "--elastic": _add_elastic_options, "--kv-sizing": _add_kv_sizing_options}
    for flag, (title, help) in _MODES.items():
        group = bench.add_argument_group(title)
        group.add_argument(flag, action="store_true", help=help)
        more[flag](group)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m graphkit", description=__doc__, formatter_class=OneDefaultFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_command(sub)
    bench = sub.add_parser("bench", help="the full benchmark: strategies x capture orders, JSON + PNG + table",
                           formatter_class=OneDefaultFormatter)
    for add in (_add_workload_options, _add_run_options, _add_mode_options):
        add(bench)
    bench.add_argument("--part", help=argparse.SUPPRESS)
    bench.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    return parser


def run_isolated(cfg, argv: list[str], out_dir: Path) -> dict:
    """Run the largest-alone capture and each strategy and order in a process of its own, then merge.

    A fresh process per run keeps what one run leaves behind (framework caches, and the driver's
    own memory for instantiated graphs, which it keeps for reuse) out of the next run's figures.
    """
    import json
    import subprocess

    from graphkit_bench.run import merge_parts

    parts = []
    names = ["graph-floor", "largest-alone", *(f"{s}:{o}" for o in cfg.orders for s in cfg.strategies if s != COMPILE),
             *(s for s in cfg.strategies if s == COMPILE), *([EVERY_SIZE] if cfg.every_size else [])]
    for i, name in enumerate(names):
        path = out_dir / f".part-{i}.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{i + 1}/{len(names)}] {name} in a fresh process", flush=True)
        cmd = [sys.executable, "-m", "graphkit", "bench", *argv, "--isolate", "no", "--part", name,
               "--part-out", str(path)]
        proc = subprocess.run(cmd)
        if proc.returncode != 0 or not path.exists():
            raise SystemExit(f"bench part {name!r} failed (exit code {proc.returncode})")
        parts.append(json.loads(path.read_text()))
        path.unlink()
    return merge_parts(parts, cfg.command)


def run_bench(cfg, out_dir: Path, stem: str, isolate: bool = False, argv: list[str] | None = None) -> int:
    from graphkit_bench.output import plot, row_ok, summary_table, write_json
    from graphkit_bench.run import Bench

    if isolate:
        out = run_isolated(cfg, argv or [], out_dir)
    else:
        bench = Bench(cfg)
        try:
            out = bench.run()
        finally:
            bench.close()
    write_json(out, out_dir / f"{stem}.json")
    plotted = plot(out, out_dir / f"{stem}.png")
    print(summary_table(out))
    print(f"wrote {out_dir / f'{stem}.json'}" + (f" and {out_dir / f'{stem}.png'}" if plotted else ""))
    wrong = [r for r in out["results"] if not row_ok(r)]
    return 1 if wrong else 0


def backend_error(name: str | None, device: int = 0, options: dict[str, Any] | None = None) -> str | None:
    """Why ``--backend``/``$HAL_BACKEND`` and ``--device`` cannot be used, in one line; ``None`` if they can.

    Known backends come from :func:`hal.list_backends`; an unavailable one gives its probe's reason;
    a device index is checked against the backend's device count (device 0 opened to ask).
    """
    env = os.environ.get("HAL_BACKEND")
    flag = "--backend" if name else "HAL_BACKEND" if env else "the default backend"
    infos = {info.name: info for info in hal.list_backends()}
    try:
        chosen = hal.registry.select_backend_name(name)
    except hal.HalError as exc:
        return f"no backend can be selected: {exc}"
    if chosen not in infos:
        return f"{flag}: unknown backend {chosen!r} (known: {', '.join(infos)})"
    if not infos[chosen].available:
        return f"{flag}: backend {chosen!r} is not available: {infos[chosen].reason}"
    try:  # every command captures graphs: a backend without them is named here, not in a traceback
        hal.registry.select_backend_name(chosen, requires=("graphs",))
    except hal.HalError as exc:
        return f"{flag}: {exc}"
    if device > 0:
        try:
            with hal.get_backend(chosen, device=0, **(options or {})) as be:
                count = be.device_count()
        except hal.HalError as exc:
            return f"{flag}: backend {chosen!r} cannot be opened: {exc}"
        if device >= count:
            return f"--device must be < {count}, the device count of backend {chosen!r} (got {device})"
    return None


def memory_error(args: argparse.Namespace) -> str | None:
    """Why ``--sleep-sizes`` / ``--elastic-sizes`` cannot fit on the device, in one line; ``None`` if they can."""
    flag, mib = (("--sleep-sizes", args.sleep_sizes) if args.sleep else
                 ("--elastic-sizes", args.elastic_sizes) if args.elastic else (None, None))
    if not mib:
        return None
    try:
        with hal.get_backend(args.backend, device=args.device) as be:
            total = be.mem_info().total
    except hal.HalError as exc:
        return f"{flag}: the device's memory cannot be read: {exc}"
    if max(mib) << 20 > total:
        return f"{flag}: {max(mib)} MiB is more than the device's {total >> 20} MiB"
    return None


def out_dir_error(path: Path) -> str | None:
    """Create ``path`` (parents too) and write and delete a file in it; the reason in one line if that fails."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".graphkit-write-check-"):
            pass
    except OSError as exc:
        return f"--out-dir {str(path)!r} is not a writable directory: {exc.strerror or exc}"
    return None


def validate_bench(args: argparse.Namespace, prog: str) -> None:
    """Check what the flags' own types cannot: flags together, the backend, the device, the output folder."""
    chosen = [flag for flag, on in (("--sleep", args.sleep), ("--elastic", args.elastic),
                                    ("--kv-sizing", args.kv_sizing)) if on]
    if len(chosen) > 1:
        fail(prog, f"{' and '.join(chosen)} exclude each other")
    mode = chosen[0] if chosen else "the graph bench"
    own = {"--sleep": "--sleep-sizes", "--elastic": "--elastic-sizes"}.get(mode, "--sizes")
    for flag, value in (("--sizes", args.sizes), ("--sleep-sizes", args.sleep_sizes),
                        ("--elastic-sizes", args.elastic_sizes)):
        if value is not None and flag != own:
            fail(prog, f"{flag} does not apply to {mode} (it takes {own})")
    if args.every_size and (chosen or args.workload in WORKLOADS):
        other = mode if chosen else f"--workload {args.workload}"
        fail(prog, f"--every-size applies to the decoder's bench, not to {other}")
    if not chosen:
        if args.workload in WORKLOADS:
            strategies = args.strategies or list(ENGINE_STRATEGIES)
            if set(strategies) - set(ENGINE_STRATEGIES):
                fail(prog, f"--strategies: the {args.workload} workload takes {', '.join(ENGINE_STRATEGIES)} "
                           f"(got {', '.join(strategies)})")
            if args.workload == "hf" and importlib.util.find_spec("transformers") is None:
                fail(prog, "--workload hf needs transformers (pip install 'transformers>=4.51')")
        else:
            bad = sorted(set(args.strategies or ()) - {*STRATEGIES, COMPILE})
            if bad:
                fail(prog, f"--strategies: {', '.join(bad)} are strategies of the engine and hf workloads")
            base = DecoderConfig() if args.workload == "reference" else DecoderConfig.tiny()
            heads = args.heads or base.heads
            kv_heads = args.kv_heads or base.kv_heads
            head_dim = args.head_dim or base.head_dim
            if heads % kv_heads:
                fail(prog, f"--heads must be a multiple of --kv-heads (got {heads} and {kv_heads})")
            if head_dim % 2:
                fail(prog, f"--head-dim must be even (rotary embedding pairs) (got {head_dim})")
    if args.part is not None:
        strategy, _, order = args.part.partition(":")
        if args.part_out is None:
            fail(prog, "--part needs --part-out")
        if args.part not in PARTS and not (strategy in {*STRATEGIES, COMPILE} and (order in ORDERS or (
                strategy == COMPILE and not order))):
            fail(prog, f"--part: unknown part {args.part!r}")
        return  # a child of an isolated run: the parent checked the backend, the device and the folder
    why = backend_error(args.backend, args.device)
    if why:
        fail(prog, why)
    why = memory_error(args)
    if why:
        fail(prog, why)
    why = out_dir_error(args.out_dir)
    if why:
        fail(prog, why)


def main(argv: list[str] | None = None) -> int:
    """Parse and check every flag before any work; exit code 2 and one line on stderr when one is wrong."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    prog = f"{parser.prog} {args.command}"
    command = "python -m graphkit " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.command == "demo":
        return demo(args, prog, command)
    validate_bench(args, prog)
    if args.verify:
        verifier.turn_on()
    given = list(argv if argv is not None else sys.argv[1:])
    special = measure_other(args, command)
    if special is not None:
        return special
    return decoder_bench(args, command, given[given.index("bench") + 1:])


def demo(args: argparse.Namespace, prog: str, command: str) -> int:
    """``demo``: every strategy on a tiny decoder, three capture orders (:func:`demo_config`)."""
    import torch

    for check in (lambda: backend_error(args.backend), lambda: out_dir_error(args.out_dir)):
        why = check()
        if why:
            fail(prog, why)
    name = hal.registry.select_backend_name(args.backend, requires=("graphs",))
    if name == "fake":
        # the demo's ops are too small to gain from more CPU threads, and threads that wait on each other turn
        # another process's load into steps several times slower (the timed targets become noise)
        torch.set_num_threads(1)
    cfg = demo_config(name, command)
    granule = cfg.backend_options.get("granularity")
    print(f"graphkit demo on backend {name}: a "
          f"{cfg.workload.layers}-layer decoder, {len(cfg.sizes)} batch sizes, "
          f"{len(cfg.strategies)} memory strategies x {len(cfg.orders)} capture orders ({', '.join(cfg.orders)})"
          + (f", {fmt_bytes(granule)} granules" if granule else ""))
    return run_bench(cfg, args.out_dir, "demo")


def tiny_backend_options(name: str) -> dict[str, Any]:
    """Options of backend ``name`` for the tiny decoder: fake's granule (:data:`TINY_FAKE_GRANULARITY`); a
    device's is its driver's."""
    return {"granularity": TINY_FAKE_GRANULARITY} if name == "fake" else {}


def demo_config(name: str, command: str = "python -m graphkit demo") -> BenchConfig:
    """The demo's bench on backend ``name``: every memory strategy, :data:`DEMO_ORDERS`, the tiny decoder."""
    from graphkit_bench.run import BenchConfig

    return BenchConfig(workload=DecoderConfig.tiny(), sizes=DEMO_SIZES, strategies=list(STRATEGIES),
                       orders=list(DEMO_ORDERS), backend=name, iters=5, command=command,
                       backend_options=tiny_backend_options(name))


def measure_other(args: argparse.Namespace, command: str) -> int | None:
    """``bench --sleep`` / ``--elastic`` / ``--kv-sizing`` / an engine workload; None for the decoder's bench."""
    if args.sleep:
        from graphkit_bench.sleep import run_sleep_bench

        sizes = [mib << 20 for mib in args.sleep_sizes] if args.sleep_sizes else None
        return run_sleep_bench(args.backend, args.device, sizes, args.cycles, args.out_dir, command,
                               rounds=args.rounds or 3)
    if args.elastic:
        from graphkit_bench.elastic import run_elastic_bench

        sizes = [mib << 20 for mib in args.elastic_sizes] if args.elastic_sizes else None
        return run_elastic_bench(args.backend, args.device, sizes, args.out_dir, command,
                                 alternations=args.rounds or 5)
    if args.kv_sizing:
        from graphkit_bench.kv_sizing import run_kv_sizing_bench

        name = hal.registry.select_backend_name(args.backend, requires=("graphs",))
        sizes = args.sizes or ([1, 2, 4, 8] if args.engine_config == "tiny" else list(ENGINE_SIZES))
        return run_kv_sizing_bench(
            args.backend, args.device, args.engine_config, sizes, args.runs,
            None if args.kv_margin_mib is None else args.kv_margin_mib << 20,
            None if args.kv_estimate_mib is None else args.kv_estimate_mib << 20, args.seed,
            args.isolate == "yes" or (args.isolate == "auto" and name != "fake"), args.out_dir, command)
    if args.workload in WORKLOADS:
        return engine_bench(args, command)
    return None


def decoder_bench(args: argparse.Namespace, command: str, user_argv: list[str]) -> int:
    """``bench`` on the decoder: every strategy and order; ``user_argv`` is the bench's own options."""
    from graphkit_bench.run import REFERENCE_SIZES, BenchConfig

    strategies = args.strategies or [*STRATEGIES, COMPILE]
    base = DecoderConfig() if args.workload == "reference" else DecoderConfig.tiny()
    overrides = {k: getattr(args, k) for k in base.as_dict() if getattr(args, k, None) is not None}
    workload = DecoderConfig(**{**base.as_dict(), **overrides})
    sizes = args.sizes or (REFERENCE_SIZES if args.workload == "reference" else DEMO_SIZES)
    name = hal.registry.select_backend_name(args.backend, requires=("graphs",))
    cfg = BenchConfig(workload=workload, sizes=sizes, strategies=strategies, orders=args.orders,
                      backend=args.backend, device=args.device, iters=args.iters,
                      compile_budget_s=args.compile_budget, seed=args.seed, progress=not args.no_progress,
                      command=command, every_size=args.every_size,
                      backend_options=tiny_backend_options(name) if args.workload == "tiny" else {})
    if name == "fake":
        import torch

        torch.set_num_threads(1)  # as the demo: small ops gain nothing from threads that wait on each other
    if args.part:
        return run_part(cfg, args.part, args.part_out)
    isolate = args.isolate == "yes" or (
        args.isolate == "auto"
        and hal.get_backend(args.backend, device=args.device, requires=("graphs",)).torch_device().type != "cpu")
    return run_bench(cfg, args.out_dir, "bench", isolate=isolate, argv=user_argv)  # user_argv: for child processes


def engine_bench(args: argparse.Namespace, command: str) -> int:
    """``--workload engine`` / ``hf``: an engine's own capture loop under every strategy and order."""
    strategies = args.strategies or list(ENGINE_STRATEGIES)
    name = hal.registry.select_backend_name(args.backend, requires=("graphs",))
    isolate = args.isolate == "yes" or (args.isolate == "auto" and name != "fake")
    return run_engine_bench(args.workload, args.engine_config, args.sizes or list(ENGINE_SIZES), strategies,
                            args.orders, args.runs, args.backend, args.device, args.seed, args.iters, isolate,
                            args.out_dir, command, progress=not args.no_progress)


def run_part(cfg, part: str, path: Path) -> int:
    """One process of an isolated bench: the largest size alone, or one strategy in every order."""
    import json

    from graphkit_bench.run import Bench

    strategy, _, order = part.partition(":")
    if order:
        cfg.orders = [order]
    bench = Bench(cfg)
    try:
        if part in PARTS:
            out = bench.run(strategies=[], largest_alone=part == "largest-alone", floor=part == "graph-floor",
                            every_size=part == EVERY_SIZE)
        else:
            out = bench.run(strategies=[strategy], largest_alone=False, floor=False, every_size=False)
    finally:
        bench.close()
    path.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
