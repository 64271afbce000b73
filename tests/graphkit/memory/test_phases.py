"""Where graphkit's share of capture time goes (``graphkit.memory.phases``): counted only when a bench asks, per
part (routing, spaces, maps), nested parts never counted twice."""

from __future__ import annotations

import time

import torch

import graphkit
import hal
from graphkit.memory.phases import CAPTURE_TIMES


def test_graphkits_parts_of_capture_time_are_counted_only_when_asked_and_never_twice(be: hal.Backend) -> None:
    """Off, a capture counts nothing; on, graph_memory's router, the new spaces and the maps are counted apart
    (the maps made while a space is set up count as maps only), and their sum is within the capture's time."""
    w = torch.randn(64, 64)

    def capture_all(pools_scope) -> float:
        start = time.perf_counter()
        graphs = []
        with pools_scope as pools:
            for n in (8, 4, 2):
                graph = be.create_graph()
                with torch.no_grad(), be.capture(graph):
                    torch.tanh(torch.zeros(n, 64) @ w)
                graphs.append(graph)
        seconds = time.perf_counter() - start
        for graph in graphs:
            be.release_graph(graph)
        pools.close()
        return seconds

    with CAPTURE_TIMES.counting():  # counts from zero: a bench case earlier in this process left its own
        pass
    capture_all(graphkit.graph_memory(be))
    assert CAPTURE_TIMES.times.calls == {} and not CAPTURE_TIMES.on
    with CAPTURE_TIMES.counting() as parts:
        seconds = capture_all(graphkit.graph_memory(be))
    assert parts.calls["routing"] == 6  # the start and the end of three captures
    assert parts.calls["spaces"] == 3 and parts.calls["maps"] >= 3
    assert all(v >= 0 for v in parts.seconds.values()) and 0 < parts.total <= seconds
