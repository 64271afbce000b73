"""Discovery never breaks: a plugin whose import, probe or constructor fails is unavailable with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import hal
from hal.backends.fake import FakeBackend
from hal.registry import THIRD_PARTY_PRIORITY, dropped_capabilities, expected_signature, validate_plugin_class
from hal.testing.distributions import importable, write_distribution
from tests.paths import ROOT

SUB = "import threading\nimport hal\nfrom hal.backends.fake import FakeBackend\n"

MODULES = {
    "odd_ctor": SUB + textwrap.dedent("""
        class B(FakeBackend):
            def __init__(self, device=0, **options):
                raise RuntimeError('driver init failed')
    """),
    "odd_ctor_exit": SUB + textwrap.dedent("""
        class B(FakeBackend):
            def __init__(self, device=0, **options):
                raise SystemExit(4)
    """),
    "odd_ctor_typeerror": SUB + textwrap.dedent("""
        class B(FakeBackend):
            def __init__(self, device=0, **options):
                len(5)
    """),
    "odd_ctor_hal": SUB + textwrap.dedent("""
        class Driver(FakeBackend):
            def __init__(self, device=0, **options):
                raise hal.DriverError('device init failed', backend='ctor_driver', call='init', code=100)

        class Full(FakeBackend):
            def __init__(self, device=0, **options):
                raise hal.DeviceOutOfMemoryError('no room for a context', backend='ctor_oom', call='init')

        class BadDevice(FakeBackend):
            def __init__(self, device=0, **options):
                raise hal.InvalidArgumentError(f'device={device} is out of range: 1 device', backend='ctor_dev',
                                               call='get_backend')
    """),
    # hooks outside the constructor that raise what a hook must not
    "odd_hooks": SUB + textwrap.dedent("""
        class Caps(FakeBackend):
            @hal.hookimpl
            def capabilities(self):
                raise RuntimeError('capability query failed')

        class Shutdown(FakeBackend):
            @hal.hookimpl
            def shutdown(self):
                super().shutdown()
                raise RuntimeError('shutdown failed')

        class MemInfo(FakeBackend):
            @hal.hookimpl
            def mem_info(self):
                raise RuntimeError('nvml gone')

        class Count(FakeBackend):
            @hal.hookimpl
            def device_count(self):
                raise OSError('driver gone')

        class Gran(FakeBackend):
            @hal.hookimpl
            def granularity(self, recommended):
                raise ValueError('bad attribute')

        class ZeroGran(FakeBackend):
            @hal.hookimpl
            def granularity(self, recommended):
                return 0
    """),
    "odd_import_exit": "import sys\nsys.exit(3)\n",
    "odd_probe_empty": SUB + "class B(FakeBackend):\n    @classmethod\n    def probe(cls):\n        return ''\n",
    "odd_probe_false": SUB + "class B(FakeBackend):\n    @classmethod\n    def probe(cls):\n        return False\n",
    "odd_probe_kbd": SUB + "class B(FakeBackend):\n    @classmethod\n    def probe(cls):\n"
                           "        raise KeyboardInterrupt\n",
    # probes that hang until the test lets them go; STARTED tells whether they were asked at all
    "odd_hang": SUB + textwrap.dedent("""
        RELEASE = threading.Event()
        STARTED = []

        class B(FakeBackend):
            @classmethod
            def probe(cls):
                STARTED.append(cls.__name__)
                RELEASE.wait(60)
                return None

        class Late(B):
            hal_priority = 2000

        class VmmOnly:
            def __init__(self, device=0):
                self.inner = FakeBackend(device)

            @classmethod
            def probe(cls):
                STARTED.append(cls.__name__)
                RELEASE.wait(60)
                return None

        for _hook in ("device_count", "granularity", "mem_info", "create_vir_ptr", "release_vir_ptr",
                      "create_phy_mem_handle", "release_phy_mem_handle", "map", "unmap"):
            setattr(VmmOnly, _hook, getattr(FakeBackend, _hook))
    """),
    "odd_late": SUB + "class B(FakeBackend):\n    hal_priority = 1500\n",
    # declares every capability of the host recorder but leaves a graph hook out
    "odd_partial": SUB + "class B(FakeBackend):\n    hal_priority = 2000\n    create_stream = None\n",
}


def site_with(tmp_path: Path, entry_points: dict[str, str]) -> Path:
    return write_distribution(tmp_path / "site", "odd-plugins", "0.3", MODULES, {"hal.backends": entry_points})


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Restrict selection to the named backends (devices and other installed plugins stay out of it)."""
    monkeypatch.delenv("HAL_BACKEND", raising=False)

    def restrict(*names: str) -> None:
        ordered = hal.registry._by_priority
        monkeypatch.setattr(hal.registry, "_by_priority",
                            lambda entries: [e for e in ordered(entries) if e.name in names])
    return restrict


def python_m_hal(site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    child = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), **env)
    child.pop("HAL_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "hal"], capture_output=True, text=True, env=child, cwd=ROOT,
                          timeout=120)


def listing(stdout: str) -> dict[str, tuple[str, str]]:
    """``name -> (state, the line after it)`` of ``python -m hal``'s listing."""
    lines = stdout.splitlines()
    found = {}
    for i, line in enumerate(lines):
        parts = line.split()
        if line.startswith("  ") and len(parts) >= 3 and parts[1] in ("available", "unavailable"):
            found[parts[0]] = (parts[1], lines[i + 1].strip() if i + 1 < len(lines) else "")
    return found


# -- a constructor that raises ----------------------------------------------------------------


def test_python_m_hal_lists_a_plugin_whose_constructor_raises_and_exits_0(tmp_path: Path) -> None:
    site = site_with(tmp_path, {"ctor": "odd_ctor:B", "ctor_exit": "odd_ctor_exit:B", "imp_exit": "odd_import_exit:B",
                                "partial": "odd_partial:B"})
    proc = python_m_hal(site)
    assert proc.returncode == 0, proc.stderr
    found = listing(proc.stdout)
    assert found["ctor"] == ("unavailable", "reason: its constructor raised RuntimeError: driver init failed")
    assert found["ctor_exit"][0] == "unavailable" and "SystemExit(4)" in found["ctor_exit"][1]
    assert found["imp_exit"][0] == "unavailable" and "sys.exit()" in found["imp_exit"][1], proc.stdout
    assert found["fake"][0] == "available"
    assert found["partial"][0] == "available" and found["partial"][1].endswith("capabilities: memory_sharing")
    assert ("warning: declares capability 'graphs' but does not implement create_stream: implement it or leave "
            "'graphs' out of capabilities()") in proc.stdout, proc.stdout
    assert "selected by default: fake" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_selection_passes_over_a_plugin_whose_constructor_raises(tmp_path: Path, only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"ctor": "odd_ctor:B"})):
        only("ctor", "fake")
        with hal.get_backend(requires=("graphs",)) as be:
            assert be.name == "fake"
        assert {i.name: i.reason for i in hal.list_backends()}["ctor"] == (
            "its constructor raised RuntimeError: driver init failed")
        with hal.get_backend() as be:
            assert be.name == "fake"
        with pytest.raises(hal.BackendUnavailableError, match="RuntimeError: driver init failed") as info:
            hal.get_backend("ctor")
        assert info.value.backend == "ctor"


def test_a_constructor_without_a_name_is_tried_before_the_listing_knows(tmp_path: Path,
                                                                          only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"ctor": "odd_ctor:B", "ctor_exit": "odd_ctor_exit:B",
                                         "ctor_type": "odd_ctor_typeerror:B"})):
        only("ctor", "ctor_exit", "ctor_type", "fake")
        with hal.get_backend() as be:  # nothing listed yet: every constructor fails in turn
            assert be.name == "fake"
        reasons = {i.name: i.reason for i in hal.list_backends()}
        assert "SystemExit(4)" in reasons["ctor_exit"]
        assert reasons["ctor_type"].startswith("its constructor raised TypeError: "), reasons["ctor_type"]


def test_selection_passes_over_a_plugin_whose_constructor_raises_a_hal_error(tmp_path: Path,
                                                                              only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"ctor_driver": "odd_ctor_hal:Driver", "ctor_oom": "odd_ctor_hal:Full"})):
        only("ctor_driver", "ctor_oom", "fake")
        for requires in ((), ("graphs",)):
            with hal.get_backend(requires=requires) as be:
                assert be.name == "fake"
        with pytest.raises(hal.DriverError, match=r"device init failed \[native code 100\]"):
            hal.get_backend("ctor_driver")  # by name: the plugin's own error
        with pytest.raises(hal.DeviceOutOfMemoryError):
            hal.get_backend("ctor_oom")
        assert {i.name: i.available for i in hal.list_backends()}["ctor_driver"], "a hal error is not a broken plugin"


def test_a_device_index_a_plugin_refuses_is_the_callers_error_in_selection(tmp_path: Path,
                                                                             only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"ctor_dev": "odd_ctor_hal:BadDevice"})):
        only("ctor_dev", "fake")
        with pytest.raises(hal.InvalidArgumentError, match="device=0 is out of range"):
            hal.get_backend()


def test_selection_passes_over_a_plugin_whose_capabilities_raise(tmp_path: Path,
                                                                  only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"caps": "odd_hooks:Caps", "shutdown": "odd_hooks:Shutdown"})):
        only("caps", "shutdown", "fake")  # tried in this order
        for requires in ((), ("graphs",)):
            be = hal.get_backend(requires=requires)
            assert be.name == "shutdown"
            with pytest.raises(hal.PluginValidationError, match=r"shutdown\(\) raised RuntimeError: shutdown "
                                                                "failed") as info:
                be.close()
            assert info.value.backend == "shutdown" and be.closed and be.live.zero
        with hal.get_backend("caps") as be:  # by name it opens; what it can do is the plugin's error
            with pytest.raises(hal.PluginValidationError, match=r"capabilities\(\) raised RuntimeError: "
                                                                "capability query failed") as info:
                be.supports("graphs")
            assert info.value.backend == "caps" and info.value.call == "capabilities"


def test_python_m_hal_lists_plugins_whose_hooks_raise_and_exits_0(tmp_path: Path) -> None:
    site = site_with(tmp_path, {"caps": "odd_hooks:Caps", "shutdown": "odd_hooks:Shutdown",
                                "ctor_driver": "odd_ctor_hal:Driver"})
    proc = python_m_hal(site)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    found = listing(proc.stdout)
    assert "capabilities() raised RuntimeError: capability query failed" in found["caps"][1], proc.stdout
    assert "device init failed" in found["ctor_driver"][1], proc.stdout
    assert "shutdown() raised RuntimeError: shutdown failed" in proc.stdout, proc.stdout
    assert re.search(r"^selected by default: (caps|ctor_driver)$", proc.stdout, re.M) is None, proc.stdout


QUERY_PLUGINS = {"qmem": "odd_hooks:MemInfo", "qcount": "odd_hooks:Count", "qgran": "odd_hooks:Gran",
                 "zgran": "odd_hooks:ZeroGran"}


def test_a_query_hook_that_raises_or_answers_no_value_is_a_hal_error_naming_plugin_and_hook(
        tmp_path: Path) -> None:
    with importable(site_with(tmp_path, QUERY_PLUGINS)):
        cases = [("qmem", "mem_info", lambda be: be.mem_info(), r"mem_info\(\) raised RuntimeError: nvml gone"),
                 ("qcount", "device_count", lambda be: be.device_count(), r"device_count\(\) raised OSError"),
                 ("qgran", "granularity", lambda be: be.granularity, r"granularity\(\) raised ValueError"),
                 ("zgran", "granularity", lambda be: be.granularity, "the backend returned 0; a hook answers")]
        for name, hook, ask, match in cases:
            with hal.get_backend(name) as be:  # by name it opens; the broken answer is the plugin's error
                with pytest.raises(hal.PluginValidationError, match=match) as info:
                    ask(be)
                assert (info.value.backend, info.value.call) == (name, hook)


def test_selection_passes_over_a_plugin_that_cannot_tell_its_granularity(tmp_path: Path,
                                                                          only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, QUERY_PLUGINS)):
        only("qgran", "zgran", "fake")
        for requires in ((), ("graphs",)):
            with hal.get_backend(requires=requires) as be:
                assert be.name == "fake"


def test_python_m_hal_lists_plugins_whose_query_hooks_fail_and_selects_another(tmp_path: Path) -> None:
    proc = python_m_hal(site_with(tmp_path, QUERY_PLUGINS))
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "mem_info() raised RuntimeError: nvml gone" in proc.stdout, proc.stdout
    assert "device_count() raised OSError: driver gone" in proc.stdout, proc.stdout
    assert "granularity() raised ValueError: bad attribute" in proc.stdout, proc.stdout
    assert re.search(r"^selected by default: (qgran|zgran)$", proc.stdout, re.M) is None, proc.stdout


def test_unknown_options_are_still_the_callers_error(tmp_path: Path) -> None:
    with importable(site_with(tmp_path, {"ctor_type": "odd_ctor_typeerror:B"})):
        with pytest.raises(hal.InvalidArgumentError, match="bad options"):
            hal.get_backend("fake", no_such_option=1)
        assert {i.name: i.available for i in hal.list_backends()}["fake"]


# -- probes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, shown", [("odd_probe_empty", "''"), ("odd_probe_false", "False")])
def test_a_probe_returning_a_falsy_non_none_is_a_plugin_error_with_a_reason(tmp_path: Path, module: str,
                                                                            shown: str) -> None:
    with importable(site_with(tmp_path, {"odd": f"{module}:B"})):
        info = {i.name: i for i in hal.list_backends()}["odd"]
    assert not info.available
    assert info.reason == (f"probe() returned {shown}; it must return None when the backend can be used here, "
                           "else a non-empty str saying why not")


def test_a_probe_raising_a_base_exception_is_unavailable(tmp_path: Path) -> None:
    with importable(site_with(tmp_path, {"kbd": "odd_probe_kbd:B"})):
        info = {i.name: i for i in hal.list_backends()}["kbd"]
    assert not info.available and info.reason == "probe failed: KeyboardInterrupt: "


@pytest.fixture
def hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Plugins whose probes hang (``hang``, ``late``: priority 2000, ``vmmhang``: no graph hooks); 0.5 s limit."""
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", "0.5")
    site = site_with(tmp_path, {"hang": "odd_hang:B", "late": "odd_hang:Late", "vmmhang": "odd_hang:VmmOnly"})
    with importable(site):
        module = sys.modules["odd_hang"]  # loaded by the discovery importable() ran
        module.STARTED.clear()
        hal.registry._probe_cache.clear()  # forget the answers of that discovery: each test probes anew
        try:
            yield module
        finally:
            module.RELEASE.set()


def test_a_probe_that_hangs_is_given_up_on_with_a_reason(hanging: Any) -> None:
    start = time.monotonic()
    infos = {i.name: i for i in hal.list_backends(refresh=True)}
    took = time.monotonic() - start
    for name in ("hang", "late", "vmmhang"):
        assert not infos[name].available
        assert infos[name].reason.startswith("probe() did not answer within 0.5 s and was given up on"), infos[name]
        assert "HAL_PROBE_TIMEOUT" in infos[name].reason
    assert took < 5, f"three hanging probes took {took:.1f} s: they must wait together, not in turn"
    assert infos["fake"].available


def test_selection_does_not_wait_on_plugins_it_does_not_need(hanging: Any, only: Callable[..., None]) -> None:
    only("late", "vmmhang", "fake")
    start = time.monotonic()
    with hal.get_backend(requires=("graphs",)) as be:  # vmmhang lacks the hooks; late comes after fake
        assert be.name == "fake"
    with hal.get_backend() as be:
        assert be.name == "fake" or be.name == "vmmhang"
    assert hanging.STARTED.count("Late") == 0, "a plugin after the chosen one was probed"
    assert time.monotonic() - start < 5


def test_selection_gives_up_on_a_hanging_probe_it_needs(hanging: Any, only: Callable[..., None]) -> None:
    only("hang", "fake")
    start = time.monotonic()
    with hal.get_backend(requires=("graphs",)) as be:
        assert be.name == "fake"
    assert 0.4 < time.monotonic() - start < 5
    assert hanging.STARTED == ["B"]


def test_a_bad_probe_timeout_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_PROBE_TIMEOUT", "soon")
    assert hal.registry.probe_timeout() == hal.registry.PROBE_TIMEOUT


# -- priority -------------------------------------------------------------------------------------


def test_a_plugin_declares_a_lower_priority(tmp_path: Path, only: Callable[..., None]) -> None:
    with importable(site_with(tmp_path, {"late": "odd_late:B"})):
        infos = [i for i in hal.list_backends() if i.name in ("late", "fake")]
        assert [(i.name, i.priority) for i in infos] == [("fake", 1000), ("late", 1500)]
        only("late", "fake")
        with hal.get_backend(requires=("graphs",)) as be:
            assert be.name == "fake"
        with hal.get_backend("late") as be:
            assert be.name == "late"


@pytest.mark.parametrize("priority", [5, "low", True])
def test_a_priority_before_the_devices_is_refused(priority: object) -> None:
    cls = type("Eager", (FakeBackend,), {"hal_priority": priority})
    with pytest.raises(hal.PluginValidationError, match=f"hal_priority={priority!r} must be an int >= "
                                                        f"{THIRD_PARTY_PRIORITY}"):
        validate_plugin_class("eager", cls)


# -- messages that say what to do -----------------------------------------------------------------


def test_a_misspelt_hook_suggests_the_right_name() -> None:
    class Misspelt(FakeBackend):
        @hal.hookimpl
        def create_vir_pointer(self, size: int) -> int:
            return 0

    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("misspelt", Misspelt)
    assert "unknown hook create_vir_pointer; did you mean create_vir_ptr?" in str(info.value)


def test_a_hook_override_without_the_marker_is_refused_at_load() -> None:
    class Caps(FakeBackend):
        def capabilities(self) -> frozenset[str]:  # the docs say "override capabilities to declare less"
            return frozenset({"graphs"})

    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("caps", Caps)
    assert ("method capabilities is named after a hook but not marked @hal.hookimpl, so hal does not see it and "
            "the backend has no capabilities at all: put @hal.hookimpl above 'def capabilities'") in str(info.value)

    class Marked(FakeBackend):
        @hal.hookimpl
        def capabilities(self) -> frozenset[str]:
            return frozenset({"graphs"})

    validate_plugin_class("marked", Marked)


def test_a_hook_far_from_every_name_lists_the_hooks() -> None:
    class Odd(FakeBackend):
        @hal.hookimpl
        def frobnicate(self) -> None:
            return None

    with pytest.raises(hal.PluginValidationError, match="unknown hook frobnicate; the hooks are: device_count, "):
        validate_plugin_class("odd", Odd)


def test_a_renamed_argument_shows_the_expected_signature() -> None:
    class Renamed(FakeBackend):
        @hal.hookimpl
        def unmap(self, address: int, size: int) -> None:
            return None

    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("renamed", Renamed)
    assert ("hook unmap takes argument(s) address that the contract does not have; expected "
            "def unmap(self, ptr: int, size: int) -> None (arguments may be left out, not renamed)") in str(info.value)
    assert expected_signature("capture") == (
        "def capture(self, graph: Graph, pool: Pool | None, stream: Stream, capture_error_mode: str | None, "
        "inspect: bool) -> AbstractContextManager[Graph]")


def test_a_constructor_without_device_says_to_accept_it() -> None:
    class NoDevice(FakeBackend):
        def __init__(self, granularity: int = 2 << 20) -> None:
            super().__init__(0, granularity=granularity)

    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("nodevice", NoDevice)
    assert "the constructor must accept device= (hal builds the plugin as cls(device=N, **options))" in str(info.value)


def test_a_constructor_with_a_required_option_says_to_give_it_a_default() -> None:
    class Required(FakeBackend):
        def __init__(self, device: int, path: str) -> None:
            super().__init__(device)

    with pytest.raises(hal.PluginValidationError, match=r"argument\(s\) path need a default"):
        validate_plugin_class("required", Required)


def test_a_probe_that_is_not_a_classmethod_says_so() -> None:
    class PlainProbe(FakeBackend):
        def probe(self) -> None:  # type: ignore[override]
            return None

    with pytest.raises(hal.PluginValidationError, match="make probe a classmethod"):
        validate_plugin_class("plain", PlainProbe)


def test_an_entry_point_that_is_not_a_class_says_what_to_point_at() -> None:
    with pytest.raises(hal.PluginValidationError, match=r"names 42 \(of type int\), not a class"):
        validate_plugin_class("notclass", 42)


def test_a_declared_capability_without_its_hooks_is_explained() -> None:
    class Partial:
        probe = FakeBackend.probe

        def __init__(self, device: int = 0) -> None:
            self.inner = FakeBackend(device)

        @hal.hookimpl
        def capabilities(self) -> frozenset[str]:
            return frozenset({"graphs", "teleport"})

    for hook in ("device_count", "granularity", "mem_info", "create_vir_ptr", "release_vir_ptr",
                 "create_phy_mem_handle", "release_phy_mem_handle", "map", "unmap", "torch_device"):
        setattr(Partial, hook, getattr(FakeBackend, hook))
    with hal.Backend("partial", FakeBackend()) as fine:
        assert dropped_capabilities(fine) == []
    be = hal.Backend("partial", Partial())
    try:
        problems = dropped_capabilities(be)
    finally:
        be.close()
    assert problems[0].startswith("declares capability 'graphs' but does not implement create_stream, ")
    assert problems[0].endswith(": implement them or leave 'graphs' out of capabilities()")
    assert problems[1] == "declares unknown capability 'teleport' (hal ignores it); known: " + ", ".join(
        sorted(hal.CAPABILITIES))


def test_a_backend_name_that_is_no_string_is_a_hal_error() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="name="):
        hal.get_backend(["fake"])  # type: ignore[arg-type]
