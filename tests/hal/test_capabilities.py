"""Backend choice by capability: ``hal.get_backend(requires=...)`` and graphkit asking for what it needs.

A vmm-only plugin (no graphs, like examples/hal-hostmem) is registered in-process through a
throwaway distribution with an entry point; it outranks ``fake``, so every default choice that
needs graphs has to pass it over.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import graphkit
import hal
from hal.backends.fake import FakeBackend
from hal.registry import THIRD_PARTY_PRIORITY, select_backend_name
from hal.testing.distributions import importable, write_distribution

VMM_ONLY = textwrap.dedent('''
    """A backend with the vmm half of the contract only, over host memory."""

    import hal
    from hal.host import vm
    from hal.types import MemInfo

    OPENED = []  # every instance made
    SHUT = []  # every instance shut down


    class VmmOnlyBackend:
        def __init__(self, device=0, *, granularity=64 << 10):
            self.g = granularity
            self.chunks = {}
            OPENED.append(self)

        @classmethod
        def probe(cls):
            return vm.unavailable_reason()

        @hal.hookimpl
        def device_count(self):
            return 1

        @hal.hookimpl
        def granularity(self, recommended):
            return self.g

        @hal.hookimpl
        def mem_info(self):
            return MemInfo(free=1 << 30, total=1 << 30)

        @hal.hookimpl
        def create_vir_ptr(self, size):
            return vm.reserve(size, self.g)

        @hal.hookimpl
        def release_vir_ptr(self, ptr, size):
            vm.release(ptr, size)

        @hal.hookimpl
        def create_phy_mem_handle(self, size):
            fd = vm.create_chunk(size)
            self.chunks[fd] = size
            return fd

        @hal.hookimpl
        def release_phy_mem_handle(self, handle):
            vm.release_chunk(handle)
            del self.chunks[handle]

        @hal.hookimpl
        def map(self, ptr, size, handle):
            vm.map_chunk(ptr, size, handle)

        @hal.hookimpl
        def unmap(self, ptr, size):
            vm.unmap_chunk(ptr, size)

        @hal.hookimpl
        def shutdown(self):
            SHUT.append(self)
''')


@pytest.fixture
def vmm_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plugin ``vmmonly`` is discoverable (nothing installed); yields its module."""
    monkeypatch.delenv("HAL_BACKEND", raising=False)
    monkeypatch.setattr(hal.registry, "_passed_over_reported", set())  # each test sees its own warnings
    site = write_distribution(tmp_path / "site", "hal-vmm-only", "0.1", {"hal_vmm_only": VMM_ONLY},
                              {"hal.backends": {"vmmonly": "hal_vmm_only:VmmOnlyBackend"}})
    with importable(site):
        info = {i.name: i for i in hal.list_backends()}["vmmonly"]
        assert info.available and info.priority == THIRD_PARTY_PRIORITY, info
        names = [i.name for i in hal.list_backends() if i.available]
        assert names.index("vmmonly") < names.index("fake"), "the test needs the plugin to outrank fake"
        # the same choice on every machine: devices and other installed plugins (hal-hostmem) stay out of it
        ordered = hal.registry._by_priority
        monkeypatch.setattr(hal.registry, "_by_priority", lambda entries: [
            e for e in ordered(entries) if e.name in ("vmmonly", "fake")])
        module = sys.modules.get("hal_vmm_only")
        assert module is not None
        yield module
        assert len(module.SHUT) == len(module.OPENED), "a backend tried for its capabilities was left open"


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2 - 1) + x.sum(dim=1, keepdim=True)


# -- hal.get_backend(requires=...) --------------------------------------------------------------------


def test_without_requires_the_plugin_is_chosen_as_before(vmm_only: Any) -> None:
    with hal.get_backend() as be:
        assert be.name == "vmmonly" and be.capabilities == frozenset()
    assert select_backend_name() == "vmmonly"


def test_requires_graphs_passes_the_vmm_only_plugin_over(vmm_only: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hal"):
        with hal.get_backend(requires=("graphs",), granularity=1 << 16) as be:
            assert be.name == "fake" and be.supports("graphs") and be.granularity == 1 << 16
    assert vmm_only.OPENED == [], "a plugin whose class lacks the graph hooks is passed over without being opened"
    assert any("vmmonly lacks graphs" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hal"):
        hal.get_backend(requires=["graphs"]).close()
    assert "vmmonly" not in caplog.text, "the same choice is reported once per process"


def test_select_backend_name_with_requires(vmm_only: Any) -> None:
    assert select_backend_name(requires=("graphs",)) == "fake"
    assert select_backend_name(requires="graphs") == "fake"  # one name as a str
    assert select_backend_name("vmmonly") == "vmmonly"  # without requires nothing is opened
    assert vmm_only.SHUT == vmm_only.OPENED


def test_a_named_backend_lacking_a_capability_is_refused(vmm_only: Any) -> None:
    with pytest.raises(hal.UnsupportedError) as info:
        hal.get_backend("vmmonly", requires=("graphs", "custom_pool"))
    err = info.value
    assert err.backend == "vmmonly" and err.call == "get_backend"
    assert "custom_pool, graphs" in str(err) and "it has: none" in str(err)
    assert vmm_only.SHUT == vmm_only.OPENED


def test_hal_backend_env_lacking_a_capability_is_refused(vmm_only: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_BACKEND", "vmmonly")
    with pytest.raises(hal.UnsupportedError, match=r"vmmonly\.get_backend: lacks the required capability graphs.*"
                                                   r"HAL_BACKEND"):
        hal.get_backend(requires=("graphs",))
    with hal.get_backend() as be:  # nothing required: the env still chooses
        assert be.name == "vmmonly"


def test_when_no_backend_has_them_every_one_is_named(vmm_only: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ordered = hal.registry._by_priority
    monkeypatch.setattr(hal.registry, "_by_priority", lambda entries: [e for e in ordered(entries)
                                                                         if e.name == "vmmonly"])
    with pytest.raises(hal.UnsupportedError) as info:
        hal.get_backend(requires=("graphs",))
    assert "no available backend has the capabilities graphs: vmmonly lacks graphs" in str(info.value)


@pytest.mark.parametrize("requires, match", [
    (("graph",), ("unknown capability 'graph'; known: capture_routing, custom_pool, graph_addresses, "
                  "graph_update, graphs, lazy_graphs, memory_sharing, unmap_waits, use_pool")),
    (42, "requires=42 must be an iterable of capability names"),
])
def test_bad_requires_are_refused(requires: Any, match: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=match):
        hal.get_backend("fake", requires=requires)


def test_fake_has_every_capability_but_an_unmap_that_waits() -> None:
    every = hal.CAPABILITIES - {"unmap_waits"}  # its callers wait: that is what the asynchronous fake checks
    with hal.get_backend("fake", requires=every, granularity=1 << 16) as be:
        assert be.capabilities == every


# -- the facade: one meaning of "not implemented" ----------------------------------------------------


def test_a_missing_graph_hook_names_its_capability(vmm_only: Any) -> None:
    with hal.get_backend("vmmonly") as be:
        assert not be.implements("torch_device") and be.implements("map")
        with pytest.raises(hal.UnsupportedError) as info:
            be.torch_device()
        assert info.value.call == "torch_device" and "'graphs' capability" in str(info.value)
        with pytest.raises(hal.UnsupportedError, match="custom_pool"):
            be.create_pool(lambda n: 0, lambda p, n: None)
        with pytest.raises(hal.InvalidArgumentError, match="not a hook"):
            be.implements("torch_devices")


class _ReturnsNone(FakeBackend):
    """Answers a value hook with None instead of leaving it out."""

    @hal.hookimpl
    def torch_device(self) -> Any:
        return None


class _DeclaresTooMuch(FakeBackend):
    """Declares a capability whose hook it does not implement."""

    route_captures = None  # type: ignore[assignment]  # the hook is gone


def test_none_from_a_value_hook_is_a_broken_plugin() -> None:
    with hal.Backend("returnsnone", _ReturnsNone(granularity=1 << 16)) as be:
        with pytest.raises(hal.PluginValidationError, match=r"returnsnone\.torch_device: .*returned None"):
            be.torch_device()


def test_a_declared_capability_without_its_hooks_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hal"):
        with hal.Backend("toomuch", _DeclaresTooMuch(granularity=1 << 16)) as be:
            assert "capture_routing" not in be.capabilities and be.supports("graphs")
            with pytest.raises(hal.UnsupportedError, match="capture_routing"):
                be.route_captures(lambda graph, pool: hal.types.Route(pool))
    assert "declares capability 'capture_routing' but does not implement route_captures" in caplog.text


# -- graphkit asks for what it needs -------------------------------------------------------------------


def test_graph_runner_without_a_backend_runs_on_a_graph_backend(vmm_only: Any) -> None:
    runner = graphkit.GraphRunner(step, sizes=[1, 2, 4], kind="vmm", progress=False)
    try:
        assert runner.backend.name == "fake"
        runner.capture(x=torch.zeros(4, 8))
        x = torch.randn(3, 8)
        assert torch.allclose(runner(x=x), step(x), atol=1e-5)
    finally:
        runner.close()
    assert runner.backend.closed, "the runner owned its backend and must close it"


def test_graph_pools_graph_memory_and_saver_without_a_backend(vmm_only: Any) -> None:
    with graphkit.GraphPools() as pools:
        assert pools.backend.name == "fake"
    with graphkit.graph_memory() as pools:
        assert pools.backend.name == "fake" and pools.backend.supports("capture_routing")
    pools.close()
    assert pools.backend.closed
    saver = graphkit.MemorySaver()
    try:
        assert saver.backend.name == "fake" and saver.backend.supports("use_pool")
    finally:
        saver.close()


def test_the_demo_path_chooses_a_graph_backend(vmm_only: Any) -> None:
    from graphkit_bench.model import DecoderConfig
    from graphkit_bench.run import Bench, BenchConfig

    assert hal.registry.select_backend_name(None, requires=("graphs",)) == "fake"  # what the demo asks
    cfg = BenchConfig(workload=DecoderConfig.tiny(), sizes=[1, 2, 4], strategies=["vmm"], orders=["descending"],
                      iters=1, progress=False)  # backend=None: the bench chooses, as the demo's children do
    bench = Bench(cfg)
    try:
        assert bench.be.name == "fake"
        out = bench.run(largest_alone=False)
    finally:
        bench.close()
    assert [r["strategy"] for r in out["results"]] == ["vmm"]
    assert all(r["max_rel_error"] < 2e-2 for r in out["results"]), out["results"]
