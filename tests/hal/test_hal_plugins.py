"""Plugin validation at load, discovery through entry points, options, and $HAL_BACKEND."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import hal
from hal.backends.fake import FakeBackend
from hal.registry import THIRD_PARTY_PRIORITY, select_backend_name, validate_plugin_class
from hal.testing.distributions import importable, write_distribution

BAD_PLUGIN = textwrap.dedent('''
    import hal
    from hal.backends.fake import FakeBackend


    class ExtraHookBackend(FakeBackend):
        """Implements a hook the contract does not have."""

        @hal.hookimpl
        def create_buffer(self, size):
            return 0
''')


class ExtraHook(FakeBackend):
    @hal.hookimpl
    def create_buffer(self, size: int) -> int:
        return 0


class WrongArgument(FakeBackend):
    @hal.hookimpl
    def unmap(self, address: int, size: int) -> None:  # the contract says ptr
        return None


class MissingHooks:
    @classmethod
    def probe(cls) -> None:
        return None

    @hal.hookimpl
    def device_count(self) -> int:
        return 1


class NoProbe:
    pass


for _hook in ("device_count", "granularity", "mem_info", "create_vir_ptr", "release_vir_ptr",
              "create_phy_mem_handle", "release_phy_mem_handle", "map", "unmap"):
    setattr(NoProbe, _hook, getattr(FakeBackend, _hook))


# -- validate_plugin_class ---------------------------------------------------------------


def test_unknown_hook_is_refused_naming_plugin_and_hook() -> None:
    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("extra", ExtraHook)
    message = str(info.value)
    assert "extra" in message and "ExtraHook" in message and "create_buffer" in message
    assert info.value.backend == "extra"


def test_hook_with_an_argument_the_contract_lacks_is_refused() -> None:
    with pytest.raises(hal.PluginValidationError, match="unmap") as info:
        validate_plugin_class("wrongarg", WrongArgument)
    assert "address" in str(info.value)


def test_missing_required_hooks_are_named() -> None:
    with pytest.raises(hal.PluginValidationError) as info:
        validate_plugin_class("partial", MissingHooks)
    assert "create_vir_ptr" in str(info.value) and "map" in str(info.value)
    assert "device_count" not in str(info.value).split("hook(s)")[1]


def test_probe_is_required() -> None:
    with pytest.raises(hal.PluginValidationError, match="probe"):
        validate_plugin_class("noprobe", NoProbe)


def test_a_complete_plugin_passes() -> None:
    validate_plugin_class("fake", FakeBackend)  # raises if not


def test_facade_refuses_an_unknown_hook_too() -> None:
    with pytest.raises(hal.PluginValidationError, match="create_buffer"):
        hal.Backend("extra", ExtraHook())


# -- entry points ----------------------------------------------------------------------------


@pytest.fixture
def bad_distribution(tmp_path: Path) -> Iterator[Path]:
    root = write_distribution(
        tmp_path / "site", "hal-extra-hook", "1.2",
        modules={"hal_extra_hook": BAD_PLUGIN},
        entry_points={"hal.backends": {
            "extrahook": "hal_extra_hook:ExtraHookBackend",
            "unimportable": "hal_no_such_module:Backend",
        }},
    )
    with importable(root):
        yield root
    assert "extrahook" not in {i.name for i in hal.list_backends()}


def test_bad_entry_point_is_listed_unavailable_with_the_reason(bad_distribution: Path) -> None:
    infos = {i.name: i for i in hal.list_backends()}
    bad = infos["extrahook"]
    assert not bad.available
    assert bad.origin == "hal-extra-hook 1.2"
    assert bad.priority == THIRD_PARTY_PRIORITY
    assert "extrahook" in bad.reason and "create_buffer" in bad.reason
    assert not infos["unimportable"].available
    assert "ModuleNotFoundError" in infos["unimportable"].reason
    assert infos["fake"].available  # one broken plugin does not break the others


def test_get_backend_of_a_bad_entry_point_raises(bad_distribution: Path) -> None:
    with pytest.raises(hal.PluginValidationError) as info:
        hal.get_backend("extrahook")
    assert "extrahook" in str(info.value) and "create_buffer" in str(info.value)
    with pytest.raises(hal.PluginValidationError, match="hal_no_such_module"):
        hal.get_backend("unimportable")


def test_a_load_error_names_the_backend_once(bad_distribution: Path) -> None:
    reasons = {i.name: i.reason for i in hal.list_backends()}
    for name in ("extrahook", "unimportable"):
        assert not reasons[name].startswith(f"{name}:"), reasons[name]  # the listing shows the name beside it
        for _ in range(2):  # the first load and the remembered failure read the same
            with pytest.raises(hal.PluginValidationError) as info:
                hal.get_backend(name)
            text = str(info.value)
            assert text == f"{name}: {reasons[name]}", text
            assert text.count(f"{name}:") == 1 and info.value.backend == name


# -- options and selection -----------------------------------------------------------------


def test_unknown_option_names_the_option() -> None:
    with pytest.raises(hal.InvalidArgumentError) as info:
        hal.get_backend("fake", granularty=1 << 16)
    assert "granularty" in str(info.value) and info.value.backend == "fake"


def test_bad_option_value_names_the_option() -> None:
    with pytest.raises(hal.InvalidArgumentError, match="granularity"):
        hal.get_backend("fake", granularity=1000)


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(hal.BackendUnavailableError) as info:
        hal.get_backend("no-such-backend")
    assert "no-such-backend" in str(info.value) and "fake" in str(info.value)


def test_hal_backend_env_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_BACKEND", "fake")
    assert select_backend_name() == "fake"
    with hal.get_backend(granularity=1 << 16) as be:
        assert be.name == "fake" and be.granularity == 1 << 16


def test_hal_backend_env_with_an_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_BACKEND", "no-such-backend")
    with pytest.raises(hal.BackendUnavailableError, match="no-such-backend"):
        hal.get_backend()


def test_explicit_name_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_BACKEND", "no-such-backend")
    with hal.get_backend("fake", granularity=1 << 16) as be:
        assert be.name == "fake"


def test_without_env_the_first_available_by_priority_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HAL_BACKEND", raising=False)
    infos = hal.list_backends()
    assert [i.priority for i in infos] == sorted(i.priority for i in infos)
    assert select_backend_name() == next(i.name for i in infos if i.available)


def _action_results(be: hal.Backend) -> dict[str, object]:
    """What the plugin's own action hooks return over one reserve-map-unmap-release cycle."""
    plugin, gran = be.plugin, be.granularity
    ptr, handle = plugin.create_vir_ptr(size=gran), plugin.create_phy_mem_handle(size=gran)
    return {"map": plugin.map(ptr=ptr, size=gran, handle=handle), "unmap": plugin.unmap(ptr=ptr, size=gran),
            "release_phy_mem_handle": plugin.release_phy_mem_handle(handle=handle),
            "release_vir_ptr": plugin.release_vir_ptr(ptr=ptr, size=gran), "shutdown": plugin.shutdown()}


@pytest.mark.parametrize("name", ["fake", "ascend", "mlu"])
def test_action_hooks_return_none_as_the_contract_says(name: str) -> None:
    if name == "fake":
        be = hal.get_backend("fake")
    else:
        from tests.sim import compiler_reason, simulated_backend

        if compiler_reason() is not None:
            pytest.skip(str(compiler_reason()))
        be = simulated_backend(name)
    try:
        assert _action_results(be) == dict.fromkeys(
            ("map", "unmap", "release_phy_mem_handle", "release_vir_ptr", "shutdown"))
    finally:
        be.close()


def test_the_torch_hooks_actions_return_none() -> None:
    from hal.backends._native.hooks import TorchHooks

    class Glue:
        def __getattr__(self, name: str) -> object:
            return lambda *args: "done"

    class Plugin(TorchHooks):
        backend_name, torch_extension, glue = "stubbed", "torch_stub", Glue()

    plugin = Plugin()
    assert [plugin.synchronize(None), plugin.release_pool("pool"), plugin.replay("graph"),
            plugin.release_graph("graph")] == [None] * 4


@pytest.mark.parametrize("vendor, oom, invalid, native", [("ascend", 207018, 107000, "aclrtMallocPhysical"),
                                                          ("mlu", 100053, 100006, "cnMemCreate")])
def test_native_failures_are_typed_driver_errors_with_their_code(vendor: str, oom: int, invalid: int,
                                                                  native: str) -> None:
    import importlib

    lib = importlib.import_module(f"hal.backends.{vendor}.lib")
    out_of_memory, refused = lib.error_for(oom, "create_phy_mem_handle", native), lib.error_for(invalid, "map", native)
    assert isinstance(out_of_memory, hal.DriverError) and isinstance(out_of_memory, hal.DeviceOutOfMemoryError)
    assert isinstance(refused, hal.DriverError) and isinstance(refused, hal.InvalidArgumentError)
    for err, code in ((out_of_memory, oom), (refused, invalid)):
        assert (err.backend, err.code, err.native_call) == (vendor, code, native) and str(code) in str(err)
