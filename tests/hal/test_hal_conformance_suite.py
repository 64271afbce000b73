"""The conformance suite itself: it passes on fake, skips without a backend, and catches broken backends."""

from __future__ import annotations

import contextlib
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import Phase, settings

import hal
from hal.backends.fake import FakeBackend
from hal.host.tape import _compile, tensor_at
from hal.testing import Requirements, graph_suite
from hal.testing import plugin as hal_suite_plugin
from hal.testing.distributions import importable, write_distribution
from hal.testing.machine import SETTINGS, run_vmm_machine
from hal.testing.memory import HostAccess, TorchAccess, memory_access
from hal.testing.options import parse_options, parse_value, split_options
from hal.testing.runner import run_suite, suite_command

FAKE = {"granularity": 65536}


def test_documented_command() -> None:
    argv = suite_command("fake", FAKE)
    assert argv[1:] == ["-m", "pytest", "--pyargs", "hal.testing", "--hal-backend", "fake",
                        "--hal-option", "granularity=65536"]


def test_fake_passes_the_suite() -> None:
    result = run_suite("fake", FAKE)
    assert result.ok, result.output
    assert result.passed >= 60 and result.skipped == 0, result.skip_reasons  # the vmm half alone has 47


def test_fake_passes_through_torch_when_not_host_accessible() -> None:
    result = run_suite("fake", {**FAKE, "host_accessible": False}, extra_args=["-k", "Aliasing or StateMachine"])
    assert result.ok, result.output
    assert result.passed >= 5 and result.skipped == 0, result.skip_reasons


def test_without_a_backend_the_suite_is_skipped_with_a_reason() -> None:
    result = run_suite(None, extra_args=["-k", "TestQueries"])
    assert result.returncode == 0, result.output
    assert result.tests > 0 and result.skipped == result.tests
    assert all("--hal-backend" in reason for reason in result.skip_reasons)


def test_hal_backend_env_chooses_the_backend() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HAL_BACKEND"}
    env["HAL_BACKEND"] = "fake"
    result = run_suite(None, FAKE, env=env, extra_args=["-k", "TestQueries"])
    assert result.ok and result.skipped == 0, result.output


def test_unknown_backend_fails_clearly() -> None:
    result = run_suite("no-such-backend", extra_args=["-k", "TestQueries"])
    assert result.returncode != 0 and result.errors == result.tests > 0
    assert "'no-such-backend' is not installed" in result.output


def test_bad_requirement_value_is_a_usage_error() -> None:
    result = run_suite("fake", {"host_accessible": "maybe"})
    assert result.returncode == 4 and result.tests == 0  # pytest's usage-error exit code
    assert "host_accessible='maybe' must be true or false" in result.output


BROKEN = textwrap.dedent('''
    import hal
    from hal.backends.fake import FakeBackend
    from hal.host import _os as hostvm


    class NoAliasBackend(FakeBackend):
        """Each mapping gets private copy-on-write pages, and the capacity is never charged."""

        def _charge(self, call, size):
            pass

        def _refund(self, size):
            pass

        @hal.hookimpl
        def map(self, ptr, size, handle):
            fd, _ = self._chunks[handle]
            prot, flags = hostvm.PROT_READ | hostvm.PROT_WRITE, hostvm.MAP_PRIVATE | hostvm.MAP_FIXED
            assert hostvm.libc().mmap(ptr, size, prot, flags, fd, 0) == ptr
''')


def test_the_suite_catches_a_backend_that_does_not_alias(tmp_path: Path) -> None:
    site = write_distribution(tmp_path / "site", "hal-noalias", "0.1", {"hal_noalias": BROKEN},
                              {"hal.backends": {"noalias": "hal_noalias:NoAliasBackend"}})
    result = run_suite("noalias", FAKE, extra_paths=[site],
                       extra_args=["-k", "(Aliasing or OutOfMemory) and not torch"])
    assert result.returncode == 1, result.output
    assert "TestAliasing.test_write_through_one_range_read_through_another" in result.failed_tests
    assert "TestOutOfMemory.test_chunk_bigger_than_the_device" in result.failed_tests
    assert "TestAliasing.test_distinct_chunks_do_not_alias" not in result.failed_tests


def test_the_state_machine_catches_it_too(tmp_path: Path) -> None:
    site = write_distribution(tmp_path / "site", "hal-noalias", "0.1", {"hal_noalias": BROKEN},
                              {"hal.backends": {"noalias": "hal_noalias:NoAliasBackend"}})
    quick = settings(SETTINGS, phases=[Phase.generate], derandomize=True)  # no shrinking: only "it fails" matters
    with importable(site):
        with pytest.raises(AssertionError, match=r"reads .* wrote"):
            run_vmm_machine(lambda: hal.get_backend("noalias", **FAKE), HostAccess(), quick)
    run_vmm_machine(lambda: hal.get_backend("fake", **FAKE), HostAccess(), quick)  # the real fake passes


# -- the pieces -------------------------------------------------------------------------------


class SuiteOptions:
    """The command-line options the suite's pytest plugin reads, as a ``pytest.Config`` gives them."""

    def __init__(self, **given: Any) -> None:
        self.given = given

    def getoption(self, name: str) -> Any:
        return self.given.get(name, [] if name == "hal_option" else None)


def test_the_header_shows_the_requirements_the_plugin_declares(tmp_path: Path) -> None:
    source = textwrap.dedent("""
        from hal.backends.fake import FakeBackend

        class Device(FakeBackend):
            hal_requirements = {'host_accessible': False}
    """)
    site = write_distribution(tmp_path / "site", "hal-devicelike", "0.1", {"hal_devicelike": source},
                              {"hal.backends": {"devicelike": "hal_devicelike:Device"}})
    with importable(site):
        for given, shown in (([], False), (["host_accessible=true", "granularity=65536"], True)):
            header = hal_suite_plugin.pytest_report_header(SuiteOptions(hal_backend="devicelike", hal_option=given))
            options = {"granularity": 65536} if given else {}
            want = (f"hal conformance: backend=devicelike options={options} "
                    f"requirements={{'host_accessible': {shown}}} half=both")
            assert header == [want]


@pytest.mark.parametrize("text, value", [
    ("65536", 65536), ("0x10000", 65536), ("-1", -1), ("true", True), ("False", False),
    ("off", False), ("/opt/lib/libx.so", "/opt/lib/libx.so"), ("", ""),
])
def test_parse_value(text: str, value: object) -> None:
    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_parse_and_split_options() -> None:
    options = parse_options(["granularity=65536", "path=a=b", "host_accessible=0"])
    assert options == {"granularity": 65536, "path": "a=b", "host_accessible": 0}
    assert split_options(options) == ({"granularity": 65536, "path": "a=b"}, {"host_accessible": 0})
    for bad in ("granularity", "=3", "two words=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_options([bad])


class _DeviceOnly:
    hal_requirements: ClassVar[dict[str, Any]] = {"host_accessible": False}


def test_requirements_from_plugin_then_overrides() -> None:
    assert Requirements.for_plugin(object()) == Requirements(host_accessible=True)
    assert Requirements.for_plugin(_DeviceOnly()).host_accessible is False
    assert Requirements.for_plugin(_DeviceOnly(), {"host_accessible": 1}).host_accessible is True
    with pytest.raises(ValueError, match="unknown requirement 'colour'"):
        Requirements.for_plugin(object(), {"colour": "red"})
    with pytest.raises(ValueError, match="true or false"):
        Requirements.for_plugin(object(), {"host_accessible": "maybe"})


def test_memory_access_follows_requirements() -> None:
    with hal.get_backend("fake", granularity=1 << 16) as be:
        assert isinstance(memory_access(be, Requirements())[0], HostAccess)
        access, reason = memory_access(be, Requirements(host_accessible=False))
        assert isinstance(access, TorchAccess) and reason == ""
        g = be.granularity
        h = be.create_phy_mem_handle(g)
        va1, va2 = be.create_vir_ptr(g), be.create_vir_ptr(g)
        be.map(va1, g, h)
        be.map(va2, g, h)
        access.write(va1 + 8, b"torch")
        assert HostAccess().read(va2 + 8, 5) == b"torch"
        assert access.read(va2 + 8, 5) == b"torch"


# -- the graph half ---------------------------------------------------------------------------

GRAPH_CASES = "Streams or Pools or CaptureReplay or CaptureRouting or UsePool or GraphLifecycle or TensorAt"

VMM_ONLY_FAKE = textwrap.dedent('''
    from hal.api import ALL_HOOKS, REQUIRED_HOOKS
    from hal.backends.fake import FakeBackend


    class VmmOnlyFake(FakeBackend):
        """fake without a single optional hook: the vmm half only."""


    for _hook in set(ALL_HOOKS) - set(REQUIRED_HOOKS):
        setattr(VmmOnlyFake, _hook, None)
''')


class LazyReplay(FakeBackend):
    """replay() returns without running the graph."""

    @hal.hookimpl
    def replay(self, graph: Any) -> None:
        return None


class IgnoresCallbacks(FakeBackend):
    """create_pool() hands out a device pool even when given allocator callbacks."""

    @hal.hookimpl
    def create_pool(self, alloc: Any, free: Any) -> Any:
        return FakeBackend.create_pool(self, None, None)


def test_the_graph_half_skips_on_a_backend_without_graphs(tmp_path: Path) -> None:
    site = write_distribution(tmp_path / "site", "hal-vmm-only-fake", "0.1", {"hal_vmm_only_fake": VMM_ONLY_FAKE},
                              {"hal.backends": {"vmmonlyfake": "hal_vmm_only_fake:VmmOnlyFake"}})
    result = run_suite("vmmonlyfake", FAKE, extra_paths=[site], extra_args=["-k", GRAPH_CASES])
    assert result.returncode == 0 and result.tests >= 15, result.output
    assert result.skipped == result.tests, result.output
    reasons = set(result.skip_reasons)
    assert any("vmmonlyfake lacks capability graphs (it declares: none)" in r for r in reasons), reasons
    assert any("does not implement tensor_at" in r for r in reasons), reasons


def test_the_graph_half_catches_a_replay_that_does_nothing() -> None:
    with hal.Backend("lazyreplay", LazyReplay(**FAKE)) as be:
        with pytest.raises(AssertionError, match="replay did not recompute"):
            graph_suite.TestCaptureReplay().test_replay_recomputes_from_the_inputs(be)
    with hal.get_backend("fake", **FAKE) as be:  # the real fake passes the same test
        graph_suite.TestCaptureReplay().test_replay_recomputes_from_the_inputs(be)


def test_the_graph_half_catches_a_pool_that_ignores_its_callbacks() -> None:
    with hal.Backend("ignorescallbacks", IgnoresCallbacks(**FAKE)) as be:
        segments = graph_suite.Segments(be)
        with pytest.raises(AssertionError, match="never called alloc"):
            graph_suite.TestCustomPools().test_a_capture_draws_from_the_callbacks_and_release_gives_it_back(
                be, segments)
        segments = graph_suite.Segments(be)
        with pytest.raises(AssertionError, match="does not live in the pool"):
            graph_suite.TestUsePool().test_allocations_inside_the_block_live_in_the_pool(be, segments)


class ForgetsConstants(FakeBackend):
    """Keeps what a capture read only by its address: a tensor made inside the capture is freed, then read."""

    @hal.hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any) -> Any:
        return self._forgetting(graph, pool)

    @contextlib.contextmanager
    def _forgetting(self, graph: Any, pool: Any) -> Iterator[Any]:
        with self._capture(graph, pool):
            yield graph
        for i, entry in enumerate(graph.entries):
            if entry[0] == "const" and entry[1].numel() and entry[1].is_contiguous():
                t = entry[1]
                view = tensor_at(t.data_ptr(), t.numel() * t.element_size(), t.dtype, tuple(t.shape))[0]
                graph.entries[i] = ("const", view)
                graph.tensors[i] = view
        graph.program = _compile(graph)


class SkipsWrites(FakeBackend):
    """Replays only the ops that made new tensors: in-place and out= ops are lost."""

    @hal.hookimpl
    def capture(self, graph: Any, pool: Any, stream: Any) -> Any:
        return self._skipping(graph, pool)

    @contextlib.contextmanager
    def _skipping(self, graph: Any, pool: Any) -> Iterator[Any]:
        with self._capture(graph, pool):
            yield graph
        graph.ops = [op for op in graph.ops if op.fresh]
        graph.program = _compile(graph)


def test_the_graph_half_catches_a_constant_replayed_from_freed_memory() -> None:
    case = graph_suite.TestCapturedWork()
    with hal.Backend("forgetsconstants", ForgetsConstants(**FAKE)) as be:
        with pytest.raises(AssertionError, match="differs from the eager run"):
            case.test_a_constant_made_inside_the_capture_replays_with_its_values(be)
        case.test_in_place_ops_replay(be)  # inputs made before the capture stay alive: the rest passes
    with hal.get_backend("fake", **FAKE) as be:
        case.test_a_constant_made_inside_the_capture_replays_with_its_values(be)


@pytest.mark.parametrize("test", ["test_in_place_ops_replay", "test_out_variant_ops_replay", "test_views_replay"])
def test_the_graph_half_catches_lost_writes(test: str) -> None:
    case = graph_suite.TestCapturedWork()
    with hal.Backend("skipswrites", SkipsWrites(**FAKE)) as be:
        with pytest.raises(AssertionError, match="differs from the eager run"):
            getattr(case, test)(be)
    with hal.get_backend("fake", **FAKE) as be:
        getattr(case, test)(be)


def test_hal_half_runs_one_half_of_the_suite() -> None:
    vmm = run_suite("fake", FAKE, extra_args=["--hal-half", "vmm", "-v"])
    graph = run_suite("fake", FAKE, extra_args=["--hal-half", "graph", "-v"])
    assert vmm.ok and graph.ok, vmm.output + graph.output
    assert "TestAliasing::" in vmm.output and "TestCaptureReplay::" not in vmm.output
    assert "TestCaptureReplay::" in graph.output and "TestCapturedWork::" in graph.output
    assert "TestAliasing::" not in graph.output and "TestStateMachine::" not in graph.output
    assert vmm.tests >= 40 and graph.tests >= 20
    assert "half=graph" in graph.output
    wrong = run_suite("fake", FAKE, extra_args=["--hal-half", "both"])
    assert wrong.returncode == 4 and "invalid choice: 'both'" in wrong.output


GRAPHS_ONLY = textwrap.dedent('''
    import hal
    from hal.backends.fake import FakeBackend


    class GraphsOnly(FakeBackend):
        @hal.hookimpl
        def capabilities(self):
            return frozenset({"graphs"})
''')


def test_skip_reasons_say_what_the_missing_capability_is_for(tmp_path: Path) -> None:
    site = write_distribution(tmp_path / "site", "hal-graphs-only", "0.1", {"hal_graphs_only": GRAPHS_ONLY},
                              {"hal.backends": {"graphsonly": "hal_graphs_only:GraphsOnly"}})
    result = run_suite("graphsonly", FAKE, extra_paths=[site], extra_args=["--hal-half", "graph"])
    assert result.ok, result.output
    reasons = set(result.skip_reasons)
    has = "(it declares: graphs)"
    routing = f"graphsonly lacks capability capture_routing {has}; these tests route captures to the pool a router"
    assert f"{routing} chooses" in reasons, reasons
    custom = f"graphsonly lacks capability custom_pool {has}; these tests capture into pools whose segments come"
    assert f"{custom} from allocator callbacks" in reasons, reasons
    assert not any("torch work" in r for r in reasons), reasons
