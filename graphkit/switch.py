"""``GRAPHKIT_GRAPH_MEMORY=1``: graph memory for every capture of every process, on the device each runs on.

Engines run their captures in processes the user never writes a line in
(vLLM's EngineCore, its tensor-parallel workers, SGLang's schedulers,
nano-vllm's spawned ranks). With the variable set, each Python process that
starts with it serves its captures as :func:`graphkit.graph_memory` does --
every capture gets a fresh vmm space over chunks shared by all captures of
its device -- for every device it captures on, with no engine line changed:

* the start-up hook installed with the package (a ``.pth`` file) only looks
  at the variable; when it is set, it waits for ``torch`` to be imported and
  then calls :func:`start_from_environment`. Nothing heavy is imported and no
  device is touched at start-up;
* the pools of a device are made at its first capture (``torch.cuda.set_device``
  has been called by then), through :func:`hal.get_backend` for that device;
* every process logs one line per device with its graph memory once its
  captures end (no capture for ``report`` seconds) and again at exit.

The value is ``1`` (``true``, ``on``, ``yes``) or a comma-separated list of
options, which also turns it on: ``kind=vmm|shared|private``,
``outputs=kept|replay`` (see :class:`graphkit.GraphPools`: ``replay`` when the
engine reads its graphs' outputs only right after their own replay),
``verify=0|1`` (the optional isolation verifier), ``hygiene=0|1``,
``report=SECONDS`` (0: at exit only), ``executables=lazy|N|off`` (the executables
budget of :class:`graphkit.GraphPools`), ``allreduce=flashinfer|MODULE|off`` (graphkit serves the graph-buffer
registration of that vLLM-style custom all-reduce -- FlashInfer's, or the binding module's, e.g.
``vllm._custom_ops`` -- from its import on, over shareable chunks: :mod:`graphkit.graphs.allreduce`). ``0``, ``false``,
``off``, ``no`` or empty: off. A bad value raises
:class:`hal.InvalidArgumentError` naming the variable from :func:`parse` and
:func:`start_from_environment`; the start-up hook and :func:`plugin` log it
once per process instead and leave the switch off.

:func:`graphkit.graph_memory` sets the variable for the processes started inside
its block (an engine's spawned ranks), with the block's options. The value's
format is written and read in one module, :mod:`graphkit.graphs.switch_value`
(:class:`Options` and :func:`parse` are importable from here too).

:func:`start` does the same from code, and the engines' own plugin entry
points call :func:`plugin` (vLLM's ``vllm.general_plugins`` in every worker,
SGLang's ``sglang.srt.plugins`` in every scheduler), which works without the
start-up hook (a process started with ``python -S``, say).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing.util
import os
import sys
import threading
from typing import Any

import hal
from _graphkit_startup import ENV
from graphkit.graphs import allreduce
from graphkit.graphs.pools import GraphPools
from graphkit.graphs.scope import set_by_own_block
from graphkit.graphs.switch_value import Options, parse
from hal.routing import patch_imported
from hal.types import Route

log = logging.getLogger(__name__)


def _options_arg(options: Any, call: str) -> Options:
    """``options`` as :class:`Options` (None: the defaults); anything else is refused naming the fix."""
    if options is None:
        return Options()
    if not isinstance(options, Options):
        raise hal.InvalidArgumentError(
            f"options={options!r} must be a graphkit.switch.Options or None; for the variable's text, pass "
            f"graphkit.switch.parse({options!r}) (or Options(kind=..., ...))" if isinstance(options, str) else
            f"options={options!r} must be a graphkit.switch.Options or None (Options(kind=..., verify=..., "
            "hygiene=..., report=...), or graphkit.switch.parse(text))", call=call)
    return options


class ProcessGraphMemory:
    """The graph memory of every capture of this process: one :class:`GraphPools` per (backend, device), made
    at the device's first capture, routing as :func:`graphkit.graph_memory` does.

    :param options: see :class:`Options`.
    """

    def __init__(self, options: Options | None = None) -> None:
        self.options = _options_arg(options, "ProcessGraphMemory")
        self.pools: dict[tuple[str, int], GraphPools] = {}
        self._refused: dict[tuple[str, int], str] = {}  # why a device is not served (logged once)
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._unreported: set[tuple[str, int]] = set()
        self._exit_logged: int | None = None  # the process that logged this scope's lines at exit
        if self.options.allreduce:  # before the engine makes its all-reduce: its first call is followed
            allreduce.serve_on_import(self.options.allreduce)

    def route(self, backend: str, device: int, graph: Any, requested_pool: Any) -> Route | None:
        """hal's process router: the route of a capture of ``backend`` on ``device`` (None where unserved)."""
        pools = self._pools(backend, device)
        if pools is None:
            return None
        route = pools.route(graph, requested_pool)
        if route is None:
            return None
        on_end = route.on_end

        def ended(ok: bool) -> None:
            on_end(ok)
            if ok:
                self._captured((backend, device))

        return dataclasses.replace(route, on_end=ended)

    def _pools(self, backend: str, device: int) -> GraphPools | None:
        where = (backend, device)
        with self._lock:
            pools = self.pools.get(where)
            if pools is not None or where in self._refused:
                return pools
            opts = self.options
            try:
                sharing = allreduce.sharing_options(backend) if opts.allreduce else {}  # peers map the chunks
                be = hal.get_backend(backend, device=device, requires=("graphs", "capture_routing"), **sharing)
                pools = GraphPools(be, opts.kind, hygiene=opts.hygiene, verify=opts.verify,  # type: ignore[arg-type]
                                   outputs=opts.outputs, executables=opts.executables)  # type: ignore[arg-type]
            except hal.HalError as exc:
                self._refused[where] = str(exc)
                log.warning("%s=%s: the captures on %s:%d are not served (they take the framework's own memory): "
                            "%s", ENV, os.environ.get(ENV, "1"), backend, device, exc)
                return None
            pools.own_backend(for_the_process=True)
            self.pools[where] = pools
            log.debug("%s: graph pools on %s:%d", ENV, backend, device)
            return pools

    def _captured(self, where: tuple[str, int]) -> None:
        """A capture ended well: its device's report line is logged once the captures pause."""
        with self._lock:
            self._unreported.add(where)
            if self.options.report <= 0:
                return
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.options.report, self.log_reports)
            self._timer.daemon = True
            self._timer.start()

    def report_lines(self, only: set[tuple[str, int]] | None = None) -> list[str]:
        """One line per served device: its keys, chunks, spaces and what verification did (no device call)."""
        with self._lock:
            items = [(where, pools) for where, pools in self.pools.items() if only is None or where in only]
        lines = []
        for (backend, device), pools in items:
            if pools.closed:
                continue
            report = pools.report(measure=False)
            first, savings = str(report).splitlines()[0], report.savings
            executables = f"; {report.executables}" if report.executables is not None else ""
            saved = f"; {savings.line().strip()}" if savings is not None else ""
            lines.append(f"graphkit: process {os.getpid()}, {backend}:{device}: {first}{executables}{saved}")
        return lines

    def log_reports(self) -> None:
        """Log the report line of every device that captured since its last one."""
        with self._lock:
            pending, self._unreported = self._unreported, set()
        _visible()
        for line in self.report_lines(pending):
            log.info("%s", line)

    def stop(self) -> None:
        """Stop the timer; the pools stay (their graphs may still replay)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def __repr__(self) -> str:
        served = ", ".join(f"{b}:{d}" for b, d in self.pools) or "no device yet"
        return f"<graphkit.ProcessGraphMemory {self.options.kind} ({served})>"


_active: ProcessGraphMemory | None = None
_routing: contextlib.ExitStack | None = None
_start_lock = threading.Lock()


def start(options: Options | None = None) -> ProcessGraphMemory:
    """Serve every capture of this process from now on (idempotent: the running one is returned).

    :raises hal.InvalidArgumentError: ``options`` is no :class:`Options` (nor None); nothing is started.
    """
    global _active, _routing
    options = _options_arg(options, "graphkit.switch.start")
    with _start_lock:
        if _active is not None:
            return _active
        scope = ProcessGraphMemory(options)
        stack = contextlib.ExitStack()
        stack.enter_context(hal.route_every_capture(scope.route))
        _active, _routing = scope, stack
    _visible()
    atexit.register(_at_exit, scope)
    # a multiprocessing child (fork, forkserver) leaves through os._exit past the atexit handlers: multiprocessing
    # runs its own exit finalizers there (in any other process too, where _at_exit then logs nothing twice)
    multiprocessing.util.Finalize(None, _at_exit, args=(scope,), exitpriority=0)
    multiprocessing.util.register_after_fork(scope, _after_fork)
    log.debug("%s: every capture of process %d is served by graphkit", ENV, os.getpid())
    return scope


def active() -> ProcessGraphMemory | None:
    """The running :class:`ProcessGraphMemory`, or None."""
    return _active


def stop() -> None:
    """Stop serving new captures (graphs captured so far keep their memory)."""
    global _active, _routing
    with _start_lock:
        scope, stack, _active, _routing = _active, _routing, None, None
    if scope is not None:
        scope.stop()
    if stack is not None:
        stack.close()


def start_from_environment() -> ProcessGraphMemory | None:
    """:func:`start` when ``GRAPHKIT_GRAPH_MEMORY`` asks for it (the start-up hook and the engines' plugins call
    this); None when it is off."""
    options = parse(os.environ.get(ENV))
    if options is None or set_by_own_block():  # a graph_memory() block of this process serves it already
        return None
    patch_imported()  # extensions imported since (torch_npu after torch)
    return start(options)


_reported = False


def plugin() -> None:
    """The engines' plugin entry point (vLLM's ``vllm.general_plugins``, SGLang's ``sglang.srt.plugins``) and
    the start-up hook's call: :func:`start_from_environment`, as often as it is called, touching no device.

    It never raises: an engine calls it in every worker, where a bad value would stop the engine over an
    optimisation. A bad value (or a failure to start) is logged once per process and the switch stays off.
    """
    global _reported
    try:
        start_from_environment()
    except Exception as exc:  # logged below, with its traceback unless it is hal's own error
        if not _reported:
            _reported = True
            text = str(exc) if str(exc).startswith(ENV) else f"{ENV}: {type(exc).__name__}: {exc}"
            log.warning("%s -- graph memory stays off in process %d", text, os.getpid(),
                        exc_info=not isinstance(exc, hal.HalError))


def _at_exit(scope: ProcessGraphMemory) -> None:
    if scope._exit_logged == os.getpid():
        return
    scope._exit_logged = os.getpid()
    scope.stop()
    _visible()
    for line in scope.report_lines():
        log.info("%s (at exit)", line)


def _after_fork(scope: ProcessGraphMemory) -> None:
    """In a child forked by multiprocessing, which leaves through ``os._exit`` past the atexit handlers, the
    lines at exit are logged by multiprocessing's own exit finalizers."""
    multiprocessing.util.Finalize(None, _at_exit, args=(scope,), exitpriority=0)


_stderr: logging.Handler | None = None  # the handler _visible() added, while it is needed
_own_level = False  # whether _visible() set the logger's level (it puts it back with the handler)


def _visible() -> None:
    """The report lines reach stderr where the process configured no logging, and only there: checked again
    before each report, since a process started by the start-up hook sets up its logging later, if at all."""
    global _stderr, _own_level
    configured, logger = False, log
    while not configured:
        configured = any(h is not _stderr for h in logger.handlers)
        if not logger.propagate or logger.parent is None:
            break
        logger = logger.parent
    if configured and _stderr is not None:
        log.removeHandler(_stderr)
        if _own_level:
            log.setLevel(logging.NOTSET)
        _stderr, _own_level = None, False
    elif not configured and _stderr is None:
        _stderr = logging.StreamHandler(sys.stderr)
        _stderr.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(_stderr)
        _own_level = log.level == logging.NOTSET
        if _own_level:
            log.setLevel(logging.INFO)


__all__ = ["ENV", "Options", "ProcessGraphMemory", "active", "parse", "plugin", "start", "start_from_environment",
           "stop"]
