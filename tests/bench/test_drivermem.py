"""The sweep of the driver's memory of graphs (python -m graphkit_bench.graphmem sweep): its parts, its outputs, and
the lazy lever's results against the usual graphs'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hal
from graphkit_bench import drivermem, graphmem
from graphkit_bench.model import Decoder, DecoderConfig
from tests.conftest import DRIVER_STEP

SMALL = ["--nodes", "1,10", "--sizes", "1,2", "--models", "1,2", "--pieces", "1,2", "--copies", "2",
         "--lever-nodes", "10", "--rounds", "2", "--replayed", "1", "--no-progress"]


def _sweep(tmp_path: Path, backend: str, *extra: str) -> tuple[dict[str, Any], str]:
    assert graphmem.main(["sweep", "--backend", backend, "--out-dir", str(tmp_path), *SMALL, *extra]) == 0
    return json.loads((tmp_path / "drivermem.json").read_text()), (tmp_path / "drivermem.md").read_text()


@pytest.mark.slow  # three fresh processes
def test_a_small_sweep_writes_its_tables_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result, text = _sweep(tmp_path, "fake")  # each part in a process of its own
    assert capsys.readouterr().out.strip() == text.strip()  # the CLI prints what it wrote
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["levers", "nodes", "variants"]
    assert result["left_out"] == {} and result["options"]["parts"] == ["nodes", "variants", "levers"]
    assert result["machine"]["backend"] == "fake" and "--nodes 1,10" in result["command"]
    assert f"`{result['command']}`" in text and "device: fake" in text
    for head in (drivermem.NODES_HEAD, drivermem.VARIANTS_HEAD, drivermem.LEVERS_HEAD):
        assert f"| {' | '.join(head)} |" in text
    nodes = result["nodes"]
    assert [r["nodes_asked"] for r in nodes] == [1, 10] and [r["nodes"] for r in nodes] == [1, 10]
    assert all(r["graphs"] == 2 and r["driver_bytes"] is None and "host" in r["driver_why"] for r in nodes)
    assert all(r["capture_ms_per_graph"] > 0 and r["replay_ms_per_graph"] > 0 for r in nodes)
    variants = result["variants"]
    assert [(r["models"], r["pieces"], r["graphs"]) for r in variants] == [(1, 1, 2), (1, 2, 4), (2, 1, 4),
                                                                           (2, 2, 8)]
    assert variants[2]["nodes"] == 2 * variants[0]["nodes"]  # two models of one shape: twice the nodes
    assert [g["size"] for g in variants[0]["growth"]] == [2, 1]  # largest first
    levers = result["levers"]
    kinds = ["lazy instantiation", "one executable graph per topology"] * 2
    assert [r["lever"].split(" (")[0] for r in levers] == kinds
    assert [r["graphs"] for r in levers] == [2, 2, 2, 2] and all(r["equal"] for r in levers)
    assert levers[2]["replayed_graphs"] == levers[3]["replayed_graphs"] == 1  # the lever's run uses size 1 only
    assert levers[3]["executable_graphs"] == 1 and levers[3]["groups"] == [[0, 1]]  # on the host: one topology
    assert "## Lever: one executable graph per topology" in text
    assert "n/m: not measured: fake's device is the host" in text


def test_parts_can_be_chosen_and_bad_flags_are_refused(tmp_path: Path) -> None:
    result, text = _sweep(tmp_path, "fake", "--parts", "nodes")
    assert "nodes" in result and "variants" not in result and "levers" not in result
    assert "## Variants" not in text
    for bad in (["--parts", "nodes,speed"], ["--nodes", "0,1"]):
        with pytest.raises(SystemExit):
            graphmem.main(["sweep", "--backend", "fake", "--out-dir", str(tmp_path), *bad])


def test_parts_that_fail_in_their_process_are_said(tmp_path: Path) -> None:
    with pytest.raises(hal.HalError, match=r"every part failed.*nodes.*exited with status"):
        drivermem.measure_apart(["--backend", "no-such-backend", *SMALL], ["nodes", "levers"], tmp_path, "cmd")


def test_pieces_of_a_step_give_the_step() -> None:
    assert drivermem.piece_bounds(28, 4) == [(0, 7), (7, 14), (14, 21), (21, 28)]
    assert drivermem.piece_bounds(2, 2) == [(0, 1), (1, 2)]
    model = Decoder(DecoderConfig.tiny(), 4, torch.device("cpu"))
    inputs = model.example_inputs(3)
    want = model.step(**inputs)
    for pieces in (1, 2):
        model.reset_cache()
        out = None
        for work in drivermem.decoder_works(model, inputs, pieces):
            out = work(out)
        assert out is not None
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_the_lazy_lever_compares_results_and_sees_a_difference() -> None:
    with hal.get_backend("fake") as be:
        sweep = drivermem.Sweep(be, drivermem.Options(numel=16, copies=2, rounds=1, progress=False))
        x = {k: torch.zeros(16) for k in ("usual", "lazy")}

        def reset() -> None:
            for t in x.values():
                t.copy_(torch.linspace(-1, 1, 16))

        kept = drivermem.Kept()
        try:
            same = sweep.lazy_lever("same", [drivermem.elementwise_works(x["usual"], 5, 1)],
                                    [drivermem.elementwise_works(x["lazy"], 5, 1)], used=[0], reset=reset,
                                    kept=kept, pool=False)
            assert same["equal"] and same["max_rel_error"] == 0.0 and same["lazy"]["first_replay_ms"] > 0
            other = sweep.lazy_lever("other", [drivermem.elementwise_works(x["usual"], 5, 1)],
                                     [drivermem.elementwise_works(x["lazy"], 6, 1)], used=[0], reset=reset,
                                     kept=kept, pool=False)
            assert not other["equal"] and other["max_rel_error"] > 0
            assert len(kept.captured) == 4  # kept until the part ends
        finally:
            kept.release(be)


def test_captures_of_two_topologies_share_two_executable_graphs() -> None:
    with hal.get_backend("fake") as be:
        xs = [torch.linspace(-1, 1, 8) for _ in range(4)]
        want = [x.clone() for x in xs]
        nodes = [5, 6, 5, 6]
        graphs = []
        for x, n in zip(xs, nodes, strict=True):
            graphs.append(be.create_graph(lazy=True))
            with be.capture(graphs[-1]):
                drivermem.elementwise_works(x, n, 1)[0](None)
        shared = drivermem.SharedExecs(be, graphs)
        assert len(shared.execs) == 2 and shared.groups() == [[0, 2], [1, 3]] and shared.refused == 2
        for x, w in zip(xs, want, strict=True):
            x.copy_(w)
        for i in (2, 0, 3, 1, 2):
            shared.step(i)
            drivermem.elementwise_works(want[i], nodes[i], 1)[0](None)
        for x, w in zip(xs, want, strict=True):
            torch.testing.assert_close(x, w, rtol=0, atol=0)
        assert len(shared.update_s) == 4  # capture 2 runs on capture 0's executable graph: every switch updates
        for graph in graphs:
            be.release_graph(graph)


@pytest.mark.cuda
@pytest.mark.slow  # each part in a process of its own, each starting CUDA: a sweep
def test_a_small_sweep_on_a_gpu_measures_the_driver_in_its_steps_and_no_lever_keeps_more(tmp_path: Path) -> None:
    """What the driver promises on any GPU: its memory is measured (bytes, never left out or made up), in whole
    steps of its 2 MiB pages, and a lever keeps no more than the usual graphs of the same work. How many steps
    8 graphs of 100 kernels add is one generation's figure -- one on an H100, none on an H200, whose steps fall
    elsewhere -- so the sweep reports it and the test does not assert it."""
    result, text = _sweep(tmp_path, "cuda", "--config", "tiny", "--nodes", "1,100", "--copies", "8",
                          "--lever-nodes", "200", "--no-count-nodes")
    for row in result["nodes"] + result["variants"]:
        assert row["driver_why"] == "" and isinstance(row["driver_bytes"], int), row
        assert row["driver_bytes"] % DRIVER_STEP == 0, row
    assert "n/m" not in text.split("## Lever")[0]  # every node and variant row has its figure
    for lever in result["levers"]:
        assert lever["equal"], lever
        if "lazy" in lever:
            usual, lazy = lever["usual"]["driver_after_capture"], lever["lazy"]["driver_after_capture"]
            assert usual % DRIVER_STEP == 0 and lazy % DRIVER_STEP == 0, lever
            assert lazy <= usual, lever  # graphs not instantiated keep no more than instantiated ones
    elementwise = result["levers"][1]  # graphs of one topology: one executable graph
    assert elementwise["executable_graphs"] == 1, elementwise
    assert elementwise["update"]["driver"] <= elementwise["usual"]["driver"], elementwise


def test_a_lever_the_backend_lacks_or_that_fails_is_a_row_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with hal.get_backend("fake") as be:
        monkeypatch.setattr(be, "_capabilities", be.capabilities - {"graph_update"})
        opts = drivermem.Options(numel=16, copies=2, rounds=1, sizes=[1, 2], lever_nodes=3, replayed=1,
                                 config="tiny", progress=False)
        sweep = drivermem.Sweep(be, opts)

        def broken(*args: object, **kwargs: object) -> dict:
            raise hal.InvalidStateError("the device fell over", call="replay")

        monkeypatch.setattr(sweep, "lazy_lever", broken)
        rows = sweep.levers()
        assert [r["lever"] for r in rows] == [drivermem.UPDATE, drivermem.LAZY, drivermem.LAZY]
        assert "capability graph_update" in rows[0]["error"] and "fell over" in rows[1]["error"]
        assert be.live.graphs == 0  # what the levers captured is released
        text = drivermem.markdown({"machine": {"backend": "fake", "torch": "-"}, "command": "c", "when": "w",
                                   "levers": rows})
        assert f"{drivermem.LAZY} on 2 graphs of 3 elementwise kernels: not measured: InvalidStateError" in text
