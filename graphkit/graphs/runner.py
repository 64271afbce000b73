"""GraphRunner: capture a step for many batch sizes and replay the one that fits.

>>> runner = graphkit.GraphRunner(step, sizes=[1, 2, 4, 8], backend=be, kind="vmm")
>>> runner.capture(x=torch.zeros(8, 256))
>>> y = runner(x=torch.randn(3, 256))   # replays the graph of size 4, returns 3 rows

What happens on a call: pick the smallest captured size >= the batch, copy
the inputs into the static buffers (padding rows get each input's fill
value), replay, return the actual rows. Above the largest size the step
runs eagerly (or raises, if so configured). In on-demand mode a size is
captured the first time a batch needs it.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import functools
import gc
import inspect
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from tqdm.auto import tqdm

import hal
from graphkit.graphs import capture as cap
from graphkit.graphs import isolation
from graphkit.graphs.buckets import Bucket, CallPlan, CallPlans, Pieces
from graphkit.graphs.buffers import StaticInputs
from graphkit.graphs.executables import DEFAULT, Budget
from graphkit.graphs.keys import OwnedKeys
from graphkit.graphs.outputs import Outputs
from graphkit.graphs.pools import GraphPools, Kind, runner_pools
from graphkit.graphs.report import Baseline, RunnerReport, SizeReport, driver_memory
from graphkit.graphs.strategies import PoolStrategy
from graphkit.memory.closing import Closable, close_step, raise_first_failure
from graphkit.saver import GRAPHS, MemorySaver
from hal.transaction import Transaction
from hal.types import fmt_bytes

log = logging.getLogger(__name__)

Mode = Literal["full", "piecewise", "none"]
MAX_BATCH = 1 << 31
Order = Literal["descending", "ascending", "random"]
#: what an isolation error of a runner's capture advises
_ISOLATION_FIX = ("Create what the step keeps between calls (caches, workspaces) before capturing, "
                  "and pass nothing made by one size's graph to another")


@dataclass(frozen=True)
class RunnerOptions:
    """How a :class:`GraphRunner` captures, answers calls and reports; every default works.

    Pass one to ``GraphRunner(..., options=...)``, or give any field as a
    keyword (``GraphRunner(step, sizes, outputs="view")``); keywords win.
    ``dataclasses.replace(opts, on_demand=True)`` makes a variant.

    :param mode: ``"full"``, ``"piecewise"`` or ``"none"`` (always eager).
    :param between: for ``mode="piecewise"``: ``between[k]`` runs eagerly
        between piece ``k`` and ``k + 1`` as ``between[k](piece_output, **inputs)``.
    :param outputs: ``"copy"`` (fresh tensors that belong to the caller),
        ``"static"`` (buffers of the runner, valid until its next call) or
        ``"view"`` (views into the graph's memory, valid until the next
        replay of any graph of the pool).
    :param oversize: ``"eager"`` or ``"error"`` for batches above the largest size.
    :param on_demand: capture a size the first time a batch needs it.
    :param fill: per-input value for padding rows (default 0).
    :param warmup: eager runs on the capture stream before each capture.
    :param debug: check on every replay that the static inputs did not move.
    :param strict_hygiene: raise (instead of warn) when memory other than the
        outputs outlives a capture.
    :param verify: the optional isolation verifier (off by default: what a
        size's capture leaves allocated besides the outputs the runner reads
        right after each replay gets memory of its own): with ``kind="vmm"``,
        read the addresses each captured graph uses and refuse it
        (:class:`graphkit.IsolationError`) when one lies in memory another
        size keeps on the shared chunks (needs the backend's
        ``"graph_addresses"``; skipped with one log line without it).
    :param progress: show a progress bar while capturing.
    :param capture_error_mode: the backend's capture error mode (cuda:
        ``"global"``, ``"thread_local"``, ``"relaxed"``).
    :param keep_outputs: ``"strong"`` (the runner owns each graph's outputs,
        as SGLang and nano-vllm do) or ``"weak"`` (non-owning aliases, as vLLM
        does: with a shared pool only sound when captures go largest first).
        ``None`` (default): weak with ``kind="vmm"`` (each size has a space of
        its own) unless ``outputs="view"``, strong otherwise.
    :param measure_memory: give cached framework memory back around each
        capture so the per-size memory figures are exact (slower).
    :param allocator_options: options of :class:`SharedVMMAllocator` for
        ``kind="vmm"`` (``reserve_bytes``, ``max_physical_bytes``, ...).
    :param pool_strategy: a ready :class:`graphkit.graphs.strategies.PoolStrategy`
        (overrides ``kind`` and ``allocator_options``).
    :param executables: the executables budget (:mod:`graphkit.graphs.executables`): ``"lazy"`` (default: a
        size's executable made at its first call, none for a size never called), K (at most K per topology,
        the least recently used one updated to the size a call needs), ``None`` (made at each capture's end).
    """

    mode: Mode = "full"
    between: Sequence[Callable[..., Any]] = ()
    outputs: Literal["copy", "static", "view"] = "copy"
    oversize: Literal["eager", "error"] = "eager"
    on_demand: bool = False
    fill: Mapping[str, Any] | None = None
    warmup: int = 1
    debug: bool = False
    strict_hygiene: bool = False
    verify: bool = False
    progress: bool = True
    capture_error_mode: str | None = None
    keep_outputs: Literal["strong", "weak"] | None = None
    measure_memory: bool = False
    allocator_options: Mapping[str, Any] | None = None
    pool_strategy: PoolStrategy | None = None
    executables: Budget = DEFAULT


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(RunnerOptions))


def _merged_options(options: RunnerOptions | None, overrides: dict[str, Any]) -> RunnerOptions:
    """``options`` (default: the defaults) with the keyword overrides; an unknown keyword is an error."""
    unknown = sorted(set(overrides) - _OPTION_NAMES)
    if unknown:
        known = sorted(_OPTION_NAMES | {"sizes", "backend", "kind", "options", "saver"})
        close = [m for name in unknown for m in difflib.get_close_matches(name, known, n=1)]
        raise hal.InvalidArgumentError(
            f"unknown option(s) {', '.join(unknown)}" + (f" (did you mean {', '.join(close)}?)" if close else "")
            + f"; GraphRunner(fn, sizes, backend=None, kind=None, *, options=None, saver=None, **options) takes "
            f"the RunnerOptions {', '.join(sorted(_OPTION_NAMES))}", call="GraphRunner")
    return dataclasses.replace(options or RunnerOptions(), **overrides)


#: said once per runner: a batch above the largest size, and a repeated capture() that captures nothing
_EAGER = ("GraphRunner: batch %d is above the largest size %d: it runs eagerly (so do later ones; oversize='error' "
          "refuses them, a larger size in sizes= captures it)")
_NOTHING_TO_CAPTURE = ("GraphRunner.capture(): every size (%s) has its graph already, so nothing is captured; "
                       "release_size(n) drops one to capture it again, and a new GraphRunner captures other inputs")


class _Once:
    """Logs its message the first time it is called (a runner's eager batches above its largest size)."""

    def __init__(self, message: str, level: int = logging.INFO) -> None:
        self.message, self.level, self.said = message, level, False

    def __call__(self, *args: Any) -> None:
        if not self.said:
            self.said = True
            log.log(self.level, self.message, *args)


def _checked_pieces(fn: Callable[..., Any] | Sequence[Callable[..., Any]], sizes: Sequence[int],
                    opts: RunnerOptions, be: hal.Backend) -> list[Callable[..., Any]]:
    """Check the runner's sizes and options against each other and the backend; ``fn`` as a list of pieces."""

    def bad(message: str) -> hal.InvalidArgumentError:
        return hal.InvalidArgumentError(message, backend=be.name, call="GraphRunner")

    mode, between = opts.mode, opts.between
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise bad(f"sizes={sizes!r} must be a list of batch sizes to capture, e.g. sizes=[{sizes!r}] for one "
                  "size or sizes=[1, 2, 4, 8]")
    if opts.fill is not None and not isinstance(opts.fill, Mapping):
        raise bad(f"fill={opts.fill!r} must be a mapping of input name to the value its buffer's unused rows "
                  "hold, e.g. fill={'tokens': 0}, or None")
    if not isinstance(opts.warmup, int) or isinstance(opts.warmup, bool) or opts.warmup < 0:
        raise bad(f"warmup={opts.warmup!r} must be an int >= 0")
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or not 1 <= s < MAX_BATCH for s in sizes):
        raise bad(f"sizes={list(sizes)!r} must be ints in [1, 2**31)")
    if mode not in ("full", "piecewise", "none"):
        raise bad(f"mode={mode!r} must be full, piecewise or none")
    # the mode says which of the two fn is
    if mode == "piecewise" and (not isinstance(fn, Sequence) or not all(callable(p) for p in fn)):
        raise bad(f"fn={fn!r} must be a list of callables (the pieces) with mode='piecewise'")
    if mode != "piecewise" and not callable(fn):
        raise bad(f"fn={fn!r} must be a callable: the step to capture, called as fn(**inputs)")
    pieces = (list(cast("Sequence[Callable[..., Any]]", fn)) if mode == "piecewise"
              else [cast("Callable[..., Any]", fn)])
    if mode == "piecewise" and len(between) != len(pieces) - 1:
        raise bad(f"piecewise: {len(pieces)} pieces need {len(pieces) - 1} eager step(s) between them, "
                  f"got {len(between)}")
    if opts.outputs not in ("copy", "static", "view"):
        raise bad(f"outputs={opts.outputs!r} must be copy, static or view")
    if opts.keep_outputs not in ("strong", "weak", None):
        raise bad(f"keep_outputs={opts.keep_outputs!r} must be strong, weak or None")
    if opts.oversize not in ("eager", "error"):
        raise bad(f"oversize={opts.oversize!r} must be eager or error")
    if mode != "none" and not be.supports("graphs"):
        raise hal.UnsupportedError("this backend cannot capture graphs; use mode='none'",
                                   backend=be.name, call="GraphRunner")
    return pieces


def _check_backend(backend: object) -> None:
    """Refuse a ``backend=`` that is no :class:`hal.Backend` (a backend's name, say), naming the call to make."""
    if backend is not None and not isinstance(backend, hal.Backend):
        named = f"hal.get_backend({backend!r})" if isinstance(backend, str) else "hal.get_backend(...)"
        raise hal.InvalidArgumentError(f"backend={backend!r} must be a hal.Backend: pass {named} (or None: "
                                       "the best backend that runs graphs)", call="GraphRunner")


def _check_examples(static: StaticInputs | None, step: Callable[..., Any], examples: Mapping[str, torch.Tensor],
                    be: hal.Backend) -> None:
    """``capture()``'s examples: the first call's fit the step's parameters; a later call's (where given) fit the
    static buffers the first one sized. Refused saying so, before anything is captured."""
    if static is None:
        _check_input_names(step, examples, be)
        return
    if not examples:
        return
    try:
        static.check(examples, grad=False)
    except hal.InvalidArgumentError as exc:
        raise hal.InvalidArgumentError(
            f"{exc.message}: a second capture() reuses the static buffers the first one sized, so its examples must "
            "have the same names, dtypes and row shapes (a new GraphRunner captures other inputs)", backend=be.name,
            call="GraphRunner.capture") from None


def _release_or_keep(release: Callable[[Bucket], None], pending: list[Bucket], bucket: Bucket) -> None:
    """Release the bucket of a failed capture; one that would not go joins ``pending`` (close() finishes it)."""
    try:
        release(bucket)
    except hal.HalError as exc:  # the capture's own error is the one raised
        log.error("batch %d: cleaning up the failed capture failed (close() finishes it): %s", bucket.size, str(exc))
        pending.append(bucket)


def _positional_refused(count: int, static: StaticInputs | None, be: hal.Backend) -> hal.InvalidArgumentError:
    """The error of a call given its inputs by position: it names the call to make."""
    names = ", ".join(f"{n}=..." for n in (static.buffers if static is not None else ())) or "..."
    return hal.InvalidArgumentError(f"{count} positional argument(s): a GraphRunner takes its inputs by name, as "
                                    f"capture() got them: runner({names})", backend=be.name, call="GraphRunner")


def _check_input_names(fn: Callable[..., Any], inputs: Mapping[str, Any], be: hal.Backend) -> None:
    """Refuse example inputs the step cannot take by name (before any capture: not a TypeError from its call)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the call itself tells
        return
    try:
        signature.bind(**inputs)
    except TypeError as exc:
        takes = ", ".join(n for n, p in signature.parameters.items()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or "none by name"
        raise hal.InvalidArgumentError(
            f"the example inputs {', '.join(inputs) or 'none'} do not fit {getattr(fn, '__name__', fn)!r} ({exc}; its "
            f"inputs: {takes}): name each example as the step's parameter, capture(name=tensor, ...)",
            backend=be.name, call="GraphRunner.capture") from None


def _merged_examples(example: Mapping[str, torch.Tensor] | None, example_inputs: dict[str, torch.Tensor],
                     be: hal.Backend) -> dict[str, torch.Tensor]:
    """``capture()``'s example inputs: the mapping and the keywords, which must not name one input twice."""
    if example is None:
        return example_inputs
    if not isinstance(example, Mapping):
        raise hal.InvalidArgumentError(f"example={type(example).__name__} must be a mapping of input "
                                       "names to tensors", backend=be.name, call="GraphRunner.capture")
    twice = sorted(set(example) & set(example_inputs))
    if twice:
        raise hal.InvalidArgumentError(f"input(s) {', '.join(twice)} given both in example and as "
                                       "keywords", backend=be.name, call="GraphRunner.capture")
    return {**example, **example_inputs}


def _replay_scoped(be: hal.Backend, bucket: Bucket) -> list[tuple[int, int]]:
    """The blocks of ``bucket``'s pool that hold its outputs and the inputs of its later pieces: the runner reads
    them only right after the size's own replay, so they stay on the shared chunks."""
    if bucket.lease.pool is None:
        return []
    ptrs = [t.data_ptr() for t in _tensors([bucket.outputs, bucket.piece_inputs])]
    return [b for b in be.pool_active_blocks(bucket.lease.pool) if any(b[0] <= p < b[0] + b[1] for p in ptrs)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


def ordered_sizes(sizes: list[int], order: Order | Sequence[int], seed: int = 0) -> list[int]:
    """``sizes`` (ascending) in the capture order ``order`` asks for (``"random"``: shuffled with ``seed``)."""
    if isinstance(order, str) and order in ("descending", "ascending", "random"):
        ordered = sizes[::-1] if order == "descending" else list(sizes)
        if order == "random":
            random.Random(seed).shuffle(ordered)
        return ordered
    if isinstance(order, str) or sorted(set(order)) != sizes:
        raise hal.InvalidArgumentError(f"order={order!r} must be descending, ascending, random or a "
                                       f"permutation of {sizes}", call="GraphRunner.capture")
    return list(order)


def _check_unmoved(inputs: StaticInputs, be: hal.Backend) -> None:
    """``debug``: a static input that moved since capture would be read stale by the graph."""
    moved = inputs.moved()
    if moved:
        raise hal.InvalidStateError(
            f"static input(s) {', '.join(moved)} moved since capture; the graph would read stale memory",
            backend=be.name, call="GraphRunner")


def _kept_outputs(opts: RunnerOptions, kind: str) -> str:
    """How the runner holds its graphs' outputs: as asked, else weakly where each size has a space of its own
    and the caller never holds graph memory (vmm, outputs copied): nothing of one size then stays allocated
    where another size's capture could read it, and the isolation check has no graph to read."""
    if opts.keep_outputs is not None:
        return opts.keep_outputs
    return "weak" if kind == "vmm" and opts.outputs != "view" else "strong"


def _runner_pools(be: hal.Backend, opts: RunnerOptions, kind: str, saver: MemorySaver | None
                  ) -> tuple[GraphPools | None, OwnedKeys | None]:
    """A runner's pools, keyed by size, and the verbs of the keys it captures into (None for ``mode="none"``);
    ``saver`` adopts their allocator."""
    if opts.mode != "none":
        return runner_pools(be, cast("Kind", kind), strategy=opts.pool_strategy, saver=saver, verify=opts.verify,
                            executables=opts.executables, **dict(opts.allocator_options or {}))
    if saver is not None and not isinstance(saver, MemorySaver):
        raise hal.InvalidArgumentError(f"saver={saver!r} must be a graphkit.MemorySaver", backend=be.name,
                                       call="GraphRunner")
    if saver is not None:
        raise hal.UnsupportedError("kind='none' cannot sleep with a MemorySaver: use kind='vmm' on a backend "
                                   "with 'custom_pool'", backend=be.name, call="GraphRunner")
    return None, None


class GraphRunner(Closable):
    """Capture ``fn`` for several batch sizes on any hal backend and replay the one that fits.

    :param fn: the step; takes tensors (keyword arguments) whose dim 0 is the batch, returns a tensor or a
        tuple/list/dict of them. For ``mode="piecewise"`` a list of pieces; ``between[k]`` then runs eagerly
        between piece ``k`` and ``k + 1`` as ``between[k](piece_output, **inputs)`` (attention, typically).
    :param sizes: the batch sizes to capture.
    :param backend: a :class:`hal.Backend` (default: ``hal.get_backend()``, then owned and closed by the runner).
    :param kind: the pool kind, as in :class:`graphkit.GraphPools`: ``"vmm"`` (the default: a fresh virtual
        space per size over shared chunks, N sizes cost the largest), ``"shared"`` (one pool) or ``"private"``
        (a pool per size).
    :param options: a :class:`RunnerOptions` (mode, outputs, on-demand capture, padding fill, hygiene,
        progress...); defaults work.
    :param saver: a :class:`graphkit.MemorySaver`: with ``kind="vmm"`` the graphs' memory sleeps and wakes
        with its tag ``"graphs"``; calls while it is paused raise :class:`hal.InvalidStateError`.
    :param overrides: any :class:`RunnerOptions` field as a keyword (``outputs="view"``, ``on_demand=True``);
        an unknown name raises :class:`hal.InvalidArgumentError`.

    Each size's graphs draw from that size's key in :attr:`pools`, a :class:`graphkit.GraphPools` of its own.
    """

    def __init__(self, fn: Callable[..., Any] | Sequence[Callable[..., Any]], sizes: Sequence[int],
                 backend: hal.Backend | None = None, kind: str | None = None, *,
                 options: RunnerOptions | None = None, saver: MemorySaver | None = None,
                 **overrides: Any) -> None:
        kind = "vmm" if kind is None else kind
        _check_backend(backend)
        self.options = opts = _merged_options(options, overrides)
        self._owns_backend = backend is None
        self.backend = be = backend or hal.get_backend(requires=("graphs",))
        pieces = _checked_pieces(fn, sizes, opts, be)
        self.sizes = sorted(set(sizes))
        self.step = Pieces(be, pieces, list(opts.between), self.sizes[-1])
        self.max_size, self.mode, self.on_demand = self.sizes[-1], opts.mode, opts.on_demand
        self.output_mode, self.oversize = opts.outputs, opts.oversize
        self.fill, self.saver = (dict(opts.fill) if opts.fill is not None else None), saver
        self.inputs: StaticInputs | None = None
        self._outputs = Outputs(opts.outputs, self.max_size)
        self._debug = opts.debug
        self._buckets: dict[int, Bucket] = {}
        self._captured: list[int] = []  # sorted sizes with graphs
        self._plans = CallPlans(self._outputs)  # what a call at each batch does (cleared as sizes come and go)
        self._capture_order: list[int] = []  # sizes in the order they were captured
        self._stream = be.create_stream() if opts.mode != "none" else None
        self._lock = threading.RLock()  # graphs of one pool never run concurrently
        self._baseline = Baseline(be)  # the device before the first capture
        self._eager_said, self._nothing_said = _Once(_EAGER), _Once(_NOTHING_TO_CAPTURE, logging.WARNING)
        self._pending: list[Bucket] = []  # buckets whose release failed: finished by close()
        self._closed = self._close_done = False
        self.pools, self._keys = _runner_pools(be, opts, kind, saver)
        self.keep_outputs = _kept_outputs(opts, self.kind)
        self.step.weak_outputs = self.keep_outputs == "weak"
        self.step.executables = self.pools.executables if self.pools is not None else None

    @property
    def strategy(self) -> PoolStrategy | None:
        """Where the graphs' pools come from (None for ``mode="none"``)."""
        return self.pools.strategy if self.pools is not None else None

    @property
    def kind(self) -> str:
        """The pool kind: ``vmm``, ``shared``, ``private`` (or a custom strategy's), ``none`` without graphs."""
        return self.pools.kind if self.pools is not None else "none"

    @property
    def verify_stats(self) -> isolation.VerifyStats:
        """What the isolation check of the runner's captures did so far."""
        return self.pools.verify_stats if self.pools is not None else isolation.VerifyStats()

    # -- capture -------------------------------------------------------------------

    def capture(self, example: Mapping[str, torch.Tensor] | None = None, /, *,
                order: Order | Sequence[int] = "descending", seed: int = 0,
                **example_inputs: torch.Tensor) -> GraphRunner:
        """Size the static buffers from the examples and capture every size (unless on demand).

        :param example: the example inputs as a mapping; use it when an input is named like a keyword of this
            method (``order``, ``seed``): ``runner.capture({"order": t, "x": x})``.
        :param order: ``"descending"`` (default: largest first), ``"ascending"``, ``"random"`` (shuffled with
            ``seed``) or an explicit list of sizes.
        :param example_inputs: the example inputs as keywords (merged with ``example``).
        A second call captures what is missing (:meth:`release_size`, a failed capture) into the buffers of the
        first, which its examples must fit; with nothing missing it logs why, once.
        """
        example_inputs = _merged_examples(example, example_inputs, self.backend)
        with self._lock:
            self._check_open()
            _check_examples(self.inputs, self.step.pieces[0], example_inputs, self.backend)
            fresh = self.inputs is None
            if fresh:
                device = self.backend.torch_device()
                self.inputs = StaticInputs(example_inputs, self.max_size, self.fill, device)
                with torch.no_grad():
                    self.inputs.update(example_inputs, min(self.inputs.batch_of(
                        {k: v.to(device) for k, v in example_inputs.items()}), self.max_size), self.max_size)
            if self.mode == "none" or self.on_demand:
                return self
            todo = [s for s in ordered_sizes(self.sizes, order, seed) if s not in self._buckets]
            if not todo and not fresh:
                self._nothing_said(", ".join(map(str, self.sizes)))
            with Transaction() as tx:
                tx.append(lambda: self._unsized(fresh))
                with tqdm(total=len(todo), desc=f"capturing ({self.kind})", unit="size",
                          disable=not self.options.progress, leave=False) as bar:
                    for size in todo:
                        bar.set_postfix(batch=size)
                        self._capture_size(size)
                        bar.update()
                tx.commit()
            return self

    def _unsized(self, fresh: bool) -> None:
        """A failed first capture() captured nothing: the next one takes new examples."""
        if fresh and not self._buckets:
            self.inputs = None

    def _capture_size(self, size: int) -> Bucket:
        be, inputs, opts, pools, keys = self.backend, self.inputs, self.options, self.pools, self._keys
        assert inputs is not None and pools is not None and keys is not None  # pools exist unless mode == "none"
        self._baseline.take()
        views = inputs.views(size)
        if opts.warmup:
            cap.warm_up(be, self.step.eager, views, self._stream, opts.warmup)
        if opts.measure_memory:
            cap.release_cached_memory(be)
        used0 = be.mem_info().used
        bucket = Bucket(size, keys.lease(size))
        t0 = time.perf_counter()
        with Transaction() as tx:
            tx.append(functools.partial(_release_or_keep, self._release_bucket, self._pending, bucket))
            check = keys.check(size, _ISOLATION_FIX)
            self.step.capture(bucket, views, self._stream, capture_error_mode=opts.capture_error_mode,
                              strict_hygiene=opts.strict_hygiene,
                              verify=check if check is not None and check.read else None)
            if check is not None:
                check.done()
            keys.ended(size, _replay_scoped(be, bucket))
            be.synchronize()
            seconds = time.perf_counter() - t0
            if opts.measure_memory:
                cap.release_cached_memory(be)
            bucket.report = SizeReport(size, seconds, be.mem_info().used - used0,
                                       pools.strategy.figures().get("chunk_bytes"))
            keys.seal(size, "when the capture of its size ended")  # a size is captured once
            tx.commit()
        self._buckets[size] = bucket
        bisect.insort(self._captured, size)
        self._plans.clear()  # a batch may now be served by this size
        self._capture_order.append(size)
        log.debug("captured batch %d in %.3f s (%s more device memory)", size, seconds,
                  fmt_bytes(bucket.report.memory_delta))
        return bucket

    # -- calls ------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int | None:
        """The size whose graph serves ``batch`` (None: above every size)."""
        pool = self.sizes if self.on_demand else self._captured
        i = bisect.bisect_left(pool, batch)
        return pool[i] if i < len(pool) else None

    def __call__(self, *args: Any, **inputs: torch.Tensor) -> Any:
        """Run the step on ``inputs`` (by name) through the graph that fits; see the class doc for outputs."""
        if args:
            raise _positional_refused(len(args), self.inputs, self.backend)
        with self._lock:  # close() and captures may race this call: decide under the lock
            static = self.inputs
            if self._closed or static is None:
                self._check_open()
                raise hal.InvalidStateError("call capture(**example_inputs) first", backend=self.backend.name,
                                            call="GraphRunner")
            # every input is a tensor of the captured row shape from here on; a graph gives no gradients: a call
            # that asks for them runs eagerly, with autograd
            batch, wants_grad = static.check(inputs, grad=torch.is_grad_enabled())
            plan = self._plans.get(batch)
            size = plan.size if plan is not None else self.bucket_for(batch) if self.mode != "none" else None
            if size is None and batch > self.max_size and self.oversize == "error":
                raise hal.InvalidArgumentError(f"batch {batch} is above the largest captured size "
                                               f"{self.max_size}", backend=self.backend.name, call="GraphRunner")
            if size is None and self.mode != "none":
                self._eager_said(batch, self.max_size)
            if size is not None and not wants_grad:
                if self._debug:
                    _check_unmoved(static, self.backend)
                if self.saver is None:
                    return (plan or self._plan(static, batch, size)).run(self.step, inputs, static.views,
                                                                         self._outputs)
                # a pause waits for this block to end, and a call waits for a pause under way
                with self.saver.awake(GRAPHS, "GraphRunner"):
                    return (plan or self._plan(static, batch, size)).run(self.step, inputs, static.views,
                                                                         self._outputs)
        if wants_grad:
            return self.step.eager(**inputs)
        with torch.no_grad():
            return self.step.eager(**inputs)

    def _plan(self, static: StaticInputs, batch: int, size: int) -> CallPlan:
        """The plan of a call at ``batch``, made at its first call (capturing ``size`` on demand)."""
        return self._plans.make(batch, size, self._buckets.get(size) or self._capture_size(size), static)

    # -- figures and teardown ---------------------------------------------------------

    @property
    def captured_sizes(self) -> list[int]:
        return list(self._captured)

    def bucket(self, size: int) -> Bucket | None:
        """What ``size`` captured, to read: its graphs and their outputs, one per piece (None: not captured)."""
        return self._buckets.get(size)

    def graph_bytes(self) -> int:
        """Device memory used now beyond what was used before the first capture (bytes)."""
        return self._baseline.device_bytes()

    def report(self) -> RunnerReport:
        """Capture seconds and memory per size (in capture order), and totals (take it before :meth:`close`).

        Its driver memory is the device's growth over the captures themselves (warm-ups and what they made are
        outside), less the pools'.
        """
        self._check_open()
        reports = [r for r in (self._buckets[s].report for s in self._capture_order if s in self._buckets) if r]
        figures = self.pools.strategy.figures() if self.pools else {}
        workspaces = self._baseline.workspace_bytes()
        driver, why = driver_memory(self.backend, sum(r.memory_delta for r in reports) if reports else None,
                                    figures.get("chunk_bytes"))
        executables = self.pools.executables if self.pools is not None else None
        savings = self.pools.report(measure=False).savings if self.pools is not None else None
        return RunnerReport(self.backend.name, self.kind, self.mode, reports, self.graph_bytes(), figures,
                            sum(len(b.graphs) for b in map(self.bucket, self.captured_sizes) if b is not None),
                            driver, why, executables.stats if executables is not None else None,
                            workspaces, savings)

    def _release_bucket(self, bucket: Bucket) -> None:
        """Release every graph of a bucket, then its size's key; goes on past failures and raises the first.

        What failed stays in the bucket (a graph) or the pools (a key): releasing it again finishes the job.
        """
        errors = self.step.release(bucket)
        pools = self.pools
        assert pools is not None  # buckets exist only when mode != "none"
        if not bucket.graphs and bucket.size in pools:  # the pool goes only once no graph of it is left
            try:
                pools.release(bucket.size)
            except hal.HalError as exc:
                log.error("batch %d: its pool could not be given back: %s", bucket.size, str(exc))
                errors.append(exc)
        if errors:
            raise errors[0]

    def _forget(self, size: int) -> Bucket:
        self._captured.remove(size)
        self._plans.clear()
        self._capture_order.remove(size)
        return self._buckets.pop(size)

    def release_size(self, size: int) -> None:
        """Destroy the graph(s) of one size and give their memory back."""
        with self._lock:
            self._check_open()
            if size not in self._buckets:
                raise hal.InvalidArgumentError(f"size={size!r} has no graph (captured: {self._captured})",
                                               backend=self.backend.name, call="GraphRunner.release_size")
            self.backend.synchronize()
            gc.collect()  # tensors of its pool caught in reference cycles go while the pool exists
            bucket = self._forget(size)
            try:
                self._release_bucket(bucket)
            except hal.HalError:
                self._pending.append(bucket)  # what would not go is finished by close()
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise hal.InvalidStateError("the runner is closed", backend=self.backend.name, call="GraphRunner")

    def close(self) -> None:
        """Synchronize, drop graphs, drop pools, unmap, free ranges, release chunks. Idempotent.

        Goes on past failures and raises the first; what failed is kept, and
        ``close()`` again finishes the job. After the backend's close it only
        forgets its graphs and pools (the backend released them), with a warning.
        """
        with self._lock:
            if self._close_done:
                return
            self._closed = True  # from here on every call raises InvalidStateError
            errors: list[BaseException] = []
            self._pending.extend(self._forget(size) for size in list(self._captured))
            if self.backend.closed:  # its close released every graph (the pools' close below says so)
                self._pending.clear()
            else:
                close_step(errors, self.backend.synchronize)  # what follows waits for the device where it must
                gc.collect()  # tensors of the pools caught in reference cycles go while the pools exist
            left = []
            for bucket in self._pending:  # past failures: release what can be released
                if not close_step(errors, self._release_bucket, bucket):
                    left.append(bucket)
            self._pending = left
            if self.pools is not None and not left:  # a graph that would not go keeps its pool for the retry
                close_step(errors, self.pools.close)
            raise_first_failure(log, errors, "GraphRunner.close")
            self.inputs = None
            self._outputs.drop()
            self._close_done = True
            if self._owns_backend:
                self.backend.close()
