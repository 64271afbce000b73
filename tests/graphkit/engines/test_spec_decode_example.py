"""examples/spec-decode: a draft and a target engine, each with its own capture loop, decode speculatively with
the target's greedy tokens under every memory setup, and graphkit's setups cost the larger model's graphs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

import graphkit
import hal
from tests.paths import ROOT

PATH = ROOT / "examples" / "spec-decode" / "spec_decode.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_decode_example", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


spec_decode = _load()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models' ops are far too small for intra-op threads, which only contend on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_round_accepts_the_longest_matching_prefix_and_the_targets_next_token() -> None:
    accept = spec_decode.accept
    assert accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all right: k + 1 tokens
    assert accept([5, 6, 7], [4, 6, 7, 1]) == [4]  # the first wrong: the target's own token only
    with pytest.raises(hal.InvalidArgumentError, match="3 proposals need 4 choices"):
        accept([5, 6, 7], [5, 6, 7])


def run_all(name: str, setups: tuple[str, ...] = spec_decode.SETUPS, orders: tuple[str, ...] = spec_decode.ORDERS,
            outputs: str = "replay") -> tuple[list[dict[str, Any]], dict[str, dict[str, int]], hal.Backend]:
    be = hal.get_backend(name)
    results = [spec_decode.run_setup(be, setup, order, outputs=outputs) for order in orders for setup in setups]
    alone = {m: spec_decode.run_alone(be, m, outputs=outputs) for m in ("draft", "target")}
    return results, alone, be


@pytest.fixture(scope="module")
def fake_runs():
    """Every setup in both orders on fake (the default granule, the one the switch's pools take)."""
    results, alone, be = run_all("fake")
    live = be.live
    be.close()
    assert (live.chunks, live.ranges, live.mappings, live.pools, live.graphs) == (0, 0, 0, 0, 0), live
    return results, alone


def test_every_loop_captures_eight_sizes_or_more(fake_runs) -> None:
    results, _ = fake_runs
    for r in results:
        assert len(r["draft_sizes"]) >= 8 and len(r["target_sizes"]) >= 8
        assert r["graphs"] == len(r["draft_sizes"]) + len(r["target_sizes"])


def test_tokens_equal_eager_and_the_targets_greedy_tokens_under_every_setup(fake_runs) -> None:
    results, _ = fake_runs
    assert {(r["setup"], r["order"]) for r in results} == {(s, o) for s in spec_decode.SETUPS
                                                          for o in spec_decode.ORDERS}
    for r in results:
        assert r["tokens_equal_eager"], r["setup"]
        assert r["tokens_equal_greedy_target"], r["setup"]
        assert r["tokens"] == results[0]["tokens"]


def check_memory(results: list[dict[str, Any]], alone: dict[str, dict[str, int]], below: bool = True) -> None:
    """graphkit's setups: at least the larger model alone, at most that plus the other model's survivors, the
    same in both orders, and (``below``) below one shared pool and below separate pools."""
    by = {(r["setup"], r["order"]): r for r in results}
    larger = max(alone, key=lambda m: alone[m]["pool_bytes"])
    other = "draft" if larger == "target" else "target"
    for setup in ("scope", "switch"):
        for order in spec_decode.ORDERS:
            r = by.get((setup, order))
            if r is None:
                continue
            base = alone[larger]["pool_bytes"]
            assert base <= r["pool_bytes"] <= base + alone[other]["survivor_bytes"], (setup, order)
            if not below:
                continue
            for baseline in ("shared", "separate"):
                if (baseline, order) in by:
                    assert r["graph_bytes"] < by[baseline, order]["graph_bytes"], (setup, order, baseline)
        present = [by[setup, o]["pool_bytes"] for o in spec_decode.ORDERS if (setup, o) in by]
        assert len(set(present)) <= 1, f"{setup}: the capture order changed graphkit's memory: {present}"


def test_graphkit_costs_the_larger_model_in_either_order_and_less_than_one_shared_pool(fake_runs) -> None:
    results, alone = fake_runs
    assert alone["target"]["pool_bytes"] > alone["draft"]["pool_bytes"]
    assert all(a["survivor_bytes"] == 0 for a in alone.values())  # outputs="replay": nothing of their own
    check_memory(results, alone)
    assert spec_decode.judge(results, alone) and all(line.endswith("met") for line in spec_decode.judge(results, alone))
    for r in results:
        assert r["driver_bytes"] is None  # fake has no driver memory: not measured, not made up


def test_with_outputs_kept_each_models_survivors_add_to_the_larger_alone() -> None:
    """graphkit's default keeps what a capture leaves allocated (the logits) in memory of its own: the two models
    cost the larger one alone plus the other's survivors, whichever captures first."""
    results, alone, be = run_all("fake", setups=("scope",), outputs="kept")
    try:
        assert all(a["survivor_bytes"] > 0 for a in alone.values())
        assert all(r["tokens_equal_eager"] and r["survivor_bytes"] > 0 for r in results)
        check_memory(results, alone, below=False)
        lines = spec_decode.judge(results, alone)
        assert len(lines) == 2 and all(line.endswith("met") for line in lines)
    finally:
        be.close()


@pytest.mark.parametrize("layers, acceptance", [(2, "some"), (3, "all")])
def test_a_draft_that_is_partly_or_always_right_gives_the_same_tokens(layers: int, acceptance: str) -> None:
    """A draft made of the target's first layers (same seed: the same weights) is right some of the time; the
    target itself always. Either way the tokens are the target's greedy ones."""
    be = hal.get_backend("fake")
    target_cfg = spec_decode.CONFIGS["tiny"][1]
    dec = spec_decode.SpecDecoder(be, draft_config=dataclasses.replace(target_cfg, layers=layers), draft_seed=2)
    try:
        with graphkit.graph_memory(be) as pools:
            dec.capture("target-first")
        prompts = spec_decode.example_prompts(4, target_cfg.vocab)
        got = dec.generate(prompts, 8, keep_logits=True)
        eager = dec.generate(prompts, 8, use_graphs=False, keep_logits=True)
        assert got.tokens == eager.tokens == dec.target.generate(prompts, 8, use_graphs=False).tokens
        for a, b in zip(got.logits, eager.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if acceptance == "all":
            assert got.acceptance == 1.0 and got.rounds == 2  # 4 tokens a round
        else:
            assert 0.0 < got.acceptance < 1.0  # the slowest sequence still takes a round per token
    finally:
        dec.close()
        pools.close()
        be.close()


def test_the_command_line_prints_the_figures(capsys) -> None:
    assert spec_decode.main(["--backend", "fake", "--setup", "scope", "--setup", "shared",
                             "--order", "target-first", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["setup"] for r in out["results"]] == ["scope", "shared"]
    assert all(line.endswith("met") for line in out["targets"]) and len(out["targets"]) == 2


def test_each_setup_in_a_fresh_process_gives_the_figures_of_one_process(capsys) -> None:
    """On a device the driver keeps released graphs' memory for the next setup of a process, so there each
    setup runs in a process of its own by default; the figures are those of the same setup run here."""
    argv = ["--backend", "fake", "--setup", "scope", "--order", "draft-first", "--json"]
    assert spec_decode.main([*argv, "--fresh-processes", "yes"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert spec_decode.main([*argv, "--fresh-processes", "no"]) == 0
    here = json.loads(capsys.readouterr().out)
    keys = ("setup", "order", "graphs", "graph_bytes", "pool_bytes", "tokens", "tokens_equal_eager")
    assert [{k: r[k] for k in keys} for r in fresh["results"]] == [{k: r[k] for k in keys} for r in here["results"]]
    assert fresh["alone"] == here["alone"] and fresh["targets"] == here["targets"]


@pytest.mark.cuda
def test_on_cuda_tokens_equal_eager_and_graphkit_costs_the_larger_model() -> None:
    results, alone, be = run_all("cuda")
    try:
        for r in results:
            assert r["tokens_equal_eager"], r["setup"]
            assert r["driver_bytes"] is not None and r["driver_bytes"] >= 0, r
        check_memory(results, alone)  # pool bytes: the driver's memory of the graphs is apart
    finally:
        be.close()
