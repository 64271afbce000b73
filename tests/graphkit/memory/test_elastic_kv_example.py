"""The growing-KV-cache decode loop of examples/elastic-kv: elastic, preallocated and allocate-and-copy caches
decode the same tokens and logits; the elastic one holds at most a granule per range above what is in use,
copies nothing and never moves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import hal
from tests.paths import ROOT

EXAMPLE_PATH = ROOT / "examples" / "elastic-kv" / "elastic_kv.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_kv_example", EXAMPLE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


elastic_kv = _load()

#: small enough for a 2-core CPU in a few seconds, large enough to span several granules of 16 KiB
FAKE_WORKLOAD = elastic_kv.Workload(steps=40, max_batch=12, max_model_len=64, block_size=8, arrive_every=2)
#: on a GPU the granule is 2 MiB: a cache of 64 MiB at most, a few MiB in use
CUDA_WORKLOAD = elastic_kv.Workload(steps=256, max_batch=32, max_model_len=4096, block_size=16, arrive_every=2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are far too small for intra-op threads, which only contend on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(out: dict) -> None:
    res = out["results"]
    assert set(res) == set(elastic_kv.STRATEGIES)
    first = res["elastic"]
    for r in res.values():
        assert r["tokens"] == first["tokens"], r["strategy"]
        assert r["digests"] == first["digests"], r["strategy"]
        if r["logits"] is not None:
            assert len(r["logits"]) == len(first["logits"]) == out["workload"]["steps"]
            assert all(torch.equal(a, b) for a, b in zip(r["logits"], first["logits"], strict=True)), r["strategy"]
    assert out["checks"]["tokens_equal"] and out["checks"]["logits_equal"]

    el, pre, regrow = res["elastic"], res["prealloc"], res["regrow"]
    slack = el["ranges"] * el["granularity"]
    assert el["ranges"] == 2 * out["model"]["layers"]
    blocks = [r["blocks"] for r in el["trace"]]
    assert blocks == sorted(blocks) and blocks[-1] > blocks[0]  # the cache really grew
    for r in el["trace"]:
        assert r["used"] <= r["physical"] <= r["used"] + slack, r
    if out["backend"] == "fake":  # 2 MiB granules hold a tiny layer's K whole
        assert el["final_physical_bytes"] > el["ranges"] * el["granularity"]  # several granules per range
    assert out["checks"]["elastic_within_granule"]
    assert el["copied_bytes"] == 0 and el["moves"] == 0  # growth maps, never copies, never moves
    assert el["peak_held_bytes"] < pre["peak_held_bytes"]
    assert pre["copied_bytes"] == 0 and pre["moves"] == 0
    assert regrow["copied_bytes"] > 0 and regrow["moves"] > 0


def test_strategies_agree_and_the_elastic_cache_follows_the_load_on_fake() -> None:
    be = hal.get_backend("fake", granularity=elastic_kv.FAKE_GRANULARITY)
    try:
        out = elastic_kv.run(be, "tiny", FAKE_WORKLOAD)
        check(out)
        el = out["results"]["elastic"]
        # on fake the device's used memory is exactly the chunks: the driver's figure obeys the bound too
        assert all(r["device"] <= r["used"] + el["ranges"] * el["granularity"] for r in el["trace"])
        assert all(r["peak_device_bytes"] == r["peak_held_bytes"] for r in out["results"].values())
        assert be.live.mappings == 0 and be.live.chunks == 0, be.live  # every cache gave its memory back
    finally:
        be.close()


def test_the_command_line_runs_on_fake(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = elastic_kv.main(["--backend", "fake", "--steps", "16", "--max-batch", "6", "--max-model-len", "32",
                          "--json", str(tmp_path / "elastic-kv.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tokens equal across strategies: yes" in text and "(bit-exact): yes" in text
    assert "at every step: met" in text
    assert (tmp_path / "elastic-kv.json").exists()


def test_regrow_copies_what_it_held() -> None:
    """Allocate-and-copy moves every byte it held at each doubling: a step's copy is the old capacity."""
    be = hal.get_backend("fake", granularity=elastic_kv.FAKE_GRANULARITY)
    try:
        cfg, wl = elastic_kv.CONFIGS["tiny"][0], FAKE_WORKLOAD
        meter = elastic_kv.Meter(be)
        cache = elastic_kv.RegrowCache(be, cfg, wl, meter)
        per_block = cache.block_bytes * 2 * cfg.layers
        cache.ensure(3)
        assert cache.copied_bytes == 0 and cache.capacity == 3
        cache.ensure(4)
        assert cache.copied_bytes == 3 * per_block and cache.capacity == 6 and cache.moves == 1
        cache.ensure(6)
        assert cache.copied_bytes == 3 * per_block  # still fits
        cache.ensure(7)
        assert cache.copied_bytes == 9 * per_block and cache.capacity == 12
        cache.close()
        assert be.live.chunks == 0
    finally:
        be.close()


@pytest.mark.cuda
def test_strategies_agree_and_the_elastic_cache_follows_the_load_on_cuda() -> None:
    be = hal.get_backend("cuda")
    try:
        out = elastic_kv.run(be, "tiny", CUDA_WORKLOAD, alternations=2)
        check(out)
    finally:
        be.close()


def test_the_strategies_alternate_and_the_step_time_is_the_median_of_the_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs every strategy once, the first one rotating; the step figure is the rounds' median."""
    calls: list[str] = []
    real = elastic_kv.decode

    def recorded(be, model, wl, strategy, keep_logits=True):
        calls.append(strategy)
        out = real(be, model, wl, strategy, keep_logits=keep_logits)
        out["step_ms_median"] = {"elastic": 10.0, "prealloc": 5.0}[strategy] + len(calls)  # known, distinct times
        return out

    monkeypatch.setattr(elastic_kv, "decode", recorded)
    be = hal.get_backend("fake", granularity=elastic_kv.FAKE_GRANULARITY)
    try:
        wl = elastic_kv.Workload(steps=6, max_batch=3, max_model_len=16, block_size=8, arrive_every=2)
        out = elastic_kv.run(be, "tiny", wl, ("elastic", "prealloc"), alternations=3)
    finally:
        be.close()
    assert calls == ["elastic", "prealloc", "prealloc", "elastic", "elastic", "prealloc"]
    el, pre = out["results"]["elastic"], out["results"]["prealloc"]
    assert el["step_ms_runs"] == [11.0, 14.0, 15.0] and pre["step_ms_runs"] == [7.0, 8.0, 11.0]
    assert el["step_ms"] == {"median": 14.0, "min": 11.0, "max": 15.0, "n": 3} and el["step_ms_median"] == 14.0
    assert out["checks"]["elastic_step_ratio"] == pytest.approx(14.0 / 8.0)
    assert out["checks"]["tokens_equal"] and out["checks"]["logits_equal"] and out["alternations"] == 3
    # every strategy against the preallocated cache round by round (the rounds pair up): of 11/7, 14/8, 15/11
    assert out["checks"]["step_ratio_to_prealloc"]["elastic"]["median"] == pytest.approx(11.0 / 7.0)


def test_the_diagnostic_caches_decode_alike_and_the_report_splits_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    """elastic-premapped maps its ranges whole before the first step; prealloc-viewed reads plain memory through
    tensors made like elastic views. Both decode the same tokens; the report gives each step's phases and its
    ratio to the preallocated cache."""
    be = hal.get_backend("fake", granularity=elastic_kv.FAKE_GRANULARITY)
    try:
        wl = elastic_kv.Workload(steps=8, max_batch=4, max_model_len=64, block_size=8, arrive_every=2)
        out = elastic_kv.run(be, "tiny", wl, ("elastic", "prealloc", "elastic-premapped", "prealloc-viewed"))
    finally:
        be.close()
    res = out["results"]
    assert out["checks"]["tokens_equal"] and out["checks"]["logits_equal"]
    premapped = res["elastic-premapped"]
    assert all(r["physical"] == premapped["trace"][0]["physical"] for r in premapped["trace"])  # no growth
    assert premapped["peak_physical_bytes"] >= res["prealloc"]["peak_physical_bytes"]
    assert res["elastic"]["peak_physical_bytes"] < premapped["peak_physical_bytes"]
    assert res["prealloc-viewed"]["copied_bytes"] == 0 and res["prealloc-viewed"]["moves"] == 0
    for r in res.values():
        assert r["grow_ms"]["n"] == 1 and r["issue_ms"]["median"] > 0
        assert r["device_ms"]["n"] == 0  # fake has no device clock: the issue time is the run time
    assert set(out["checks"]["step_ratio_to_prealloc"]) == {"elastic", "elastic-premapped", "prealloc-viewed"}
    elastic_kv.print_report(out)
    text = capsys.readouterr().out
    assert "forward ms (device)" in text and "step / prealloc" in text and "prealloc-viewed" in text


@pytest.mark.cuda
def test_the_diagnostic_caches_and_the_device_time_on_cuda() -> None:
    be = hal.get_backend("cuda")
    try:
        out = elastic_kv.run(be, "tiny", CUDA_WORKLOAD, ("elastic", "prealloc", "elastic-premapped", "prealloc-viewed"))
    finally:
        be.close()
    assert out["checks"]["tokens_equal"] and out["checks"]["logits_equal"]
    assert all(r["device_ms"]["median"] > 0 for r in out["results"].values())  # CUDA events timed each forward
