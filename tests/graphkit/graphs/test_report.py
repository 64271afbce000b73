"""The reports an engine author reads: keys by the engine's names, graph counts that add up, address space apart
from memory, and the saver's report printed like the others while it stays a list."""

from __future__ import annotations

import torch

import graphkit
import hal


def _capture(be: hal.Backend, weight: torch.Tensor, n: int, pool=None) -> tuple[object, torch.Tensor]:
    graph = be.create_graph()
    with be.capture(graph, pool=pool):
        out = torch.relu(torch.zeros(n, 64) @ weight)
    return graph, out


def test_keys_of_handles_count_their_graphs_and_add_up_with_the_header(be: hal.Backend) -> None:
    weight = torch.randn(64, 64)
    with graphkit.GraphPools(be, verify=True) as pools:  # the optional verifier's count is in the header too
        graphs = [_capture(be, weight, n, pools.pool(n)) for n in (8, 4, 2)]
        graphs.append(_capture(be, weight, 2, pools.pool(2)))  # a second graph of one key
        report = pools.report()
        assert [(k.key, k.graphs) for k in report.keys] == [(8, 1), (4, 1), (2, 2)]
        assert report.graphs == report.verified_graphs == 4
        text = str(report)
        assert "3 key(s) holding 4 graph(s)" in text and "4 capture(s) verified isolated" in text
        keys = [line.split()[0] for line in text.splitlines()[1:]
                if not line.strip().startswith(("driver", "executables:", "accounting:", "saved:", "kept:"))]
        assert keys == ["8", "4", "2"]  # the engine's own keys
        be.release_graph(graphs.pop()[0])
        assert [k.graphs for k in pools.report().keys] == [1, 1, 1]  # a released graph leaves its key's count
        for graph, _ in graphs:
            be.release_graph(graph)
        del graphs


def test_graph_memorys_own_keys_read_capture_n_and_groups_keep_the_engines_key(be: hal.Backend) -> None:
    weight = torch.randn(64, 64)
    with graphkit.graph_memory(be) as pools:
        graphs = [_capture(be, weight, 4)]
        with pools.group(("decode", 16)):
            graphs.append(_capture(be, weight, 16))
    text = str(pools.report())
    assert "\n" + " " * 9 + "capture 1  used" in text and "('decode', 16)  used" in text
    assert "('capture', 1)" not in text
    for graph, _ in graphs:
        be.release_graph(graph)
    del graphs
    pools.close()


def test_address_space_is_shown_apart_from_memory(be: hal.Backend) -> None:
    weight = torch.randn(64, 64)
    with graphkit.GraphPools(be) as pools:
        graphs = [_capture(be, weight, n, pools.pool(n)) for n in (8, 4)]
        report = pools.report()
        header = str(report).splitlines()[0]
        assert report.spaces == 2 and report.reserved_bytes > report.chunk_bytes
        assert f"address space {hal.types.fmt_bytes(report.reserved_bytes)} in 2 space(s), no memory" in header
        assert f"memory {hal.types.fmt_bytes(report.chunk_bytes)} of chunks" in header
        assert "of spaces" not in header
        for graph, _ in graphs:
            be.release_graph(graph)
        del graphs
    with graphkit.GraphPools(be, kind="shared") as shared:
        text = str(shared.report())
        assert "address space" not in text and "memory from the device's own allocator" in text  # no spaces


def test_the_savers_report_prints_a_table_and_stays_a_list(be: hal.Backend) -> None:
    saver = graphkit.MemorySaver(be)
    with saver.region("weights", backup=True):
        weights = torch.randn(128, 128, device=be.torch_device())
    with saver.region("kv_cache"):
        kv = torch.empty(1 << 14, device=be.torch_device())
    saver.pause("kv_cache")
    report = saver.report()
    assert isinstance(report, list) and [r.tag for r in report] == ["weights", "kv_cache"]
    assert all(isinstance(r, graphkit.TagReport) for r in report)
    lines = str(report).splitlines()
    assert lines[0].startswith("memory saver on fake: 2 tag(s), 1 paused;")
    assert hal.types.fmt_bytes(report.footprint_bytes) in lines[0]
    assert lines[1].split()[:2] == ["weights", "awake"] and "host backup" in lines[1]
    assert lines[2].split()[:2] == ["kv_cache", "paused"] and "no backup" in lines[2]
    saver.resume()
    del weights, kv
    saver.close()
