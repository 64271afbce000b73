"""Every report says where the device's memory went (the accounting) and what the framework's own ways would cost
for the same captures (the savings line); a runner's stumbles say what happened."""

from __future__ import annotations

import logging

import pytest
import torch

import graphkit
import hal
from graphkit.graphs.report import KeyReport, Savings

W = torch.randn(256, 256)


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W) @ W.t()


@pytest.fixture
def be() -> hal.Backend:
    backend = hal.get_backend("fake", granularity=64 << 10)
    yield backend
    backend.close()


def test_the_runners_report_splits_the_devices_growth(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[1, 8, 64], backend=be, progress=False)
    runner.capture(x=torch.zeros(64, 256))
    report = runner.report()
    acc = report.accounting
    assert acc.device == report.graph_bytes and acc.chunks == report.pool_figures["chunk_bytes"]
    assert acc.executables is None  # a host device: its graphs keep no driver memory
    assert acc.rest == acc.device - acc.chunks - acc.workspaces
    text = str(report)
    assert "accounting: device +" in text and "executables: 0 for 0 graph(s)" in text and "saved: chunks" in text
    runner.close()


def test_the_savings_model_reuses_what_a_capture_freed_not_what_it_kept() -> None:
    keys = [KeyReport(n, used, used, used, 1, kept) for n, used, kept in
            [(64, 128, 64), (32, 64, 32), (16, 64, 16)]]
    savings = Savings.of(keys, chunks=192)
    assert savings is not None
    # largest first: 128 reserved, 64 kept; the next needs 64 of the 64 free; the last 64 of 32 free: +32
    assert savings.largest_first == 160
    assert savings.per_capture == 256
    ascending = Savings.of(keys[::-1], chunks=192)
    # smallest first: 64; then 64 needed, 48 free: +16; then 128 needed, 32 free: +96
    assert ascending is not None and ascending.in_order == 64 + 16 + 96
    assert "0.75 x" in Savings(256, 256, 256, 192).line()
    assert Savings.of([], 0) is None


def test_pools_and_the_switch_line_say_what_was_saved(be: hal.Backend) -> None:
    from graphkit import switch

    scope = switch.start()
    try:
        graphs = []
        for n in (64, 8):
            graph, x = be.create_graph(), torch.zeros(n, 256)
            with be.capture(graph):
                y = step(x)
            graphs.append((graph, y))
        pools = scope.pools[(be.name, be.device)]
        assert "saved: chunks" in str(pools.report())
        (line,) = scope.report_lines()
        assert "saved: chunks" in line and "executables:" in line
        for graph, _ in graphs:
            be.release_graph(graph)
    finally:
        switch.stop()
    for pools in scope.pools.values():
        pools.close()


def test_a_runner_called_after_its_backend_closed_says_so(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, executables=None, progress=False)
    runner.capture(x=torch.zeros(8, 256))
    be.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner(x=torch.randn(3, 256))
    runner.close()


def test_batches_above_the_largest_size_run_eagerly_with_one_line(be: hal.Backend,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4, 8], backend=be, progress=False)
    runner.capture(x=torch.zeros(8, 256))
    with caplog.at_level(logging.INFO, logger="graphkit.graphs.runner"):
        for batch in (9, 12, 9):
            x = torch.randn(batch, 256)
            torch.testing.assert_close(runner(x=x), step(x))
    said = [r for r in caplog.records if "above the largest size" in r.getMessage()]
    assert len(said) == 1 and "batch 9" in said[0].getMessage() and "oversize='error'" in said[0].getMessage()
    runner.close()


def test_an_unknown_keyword_names_the_signature_and_the_closest_option(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"did you mean on_demand\?") as info:
        graphkit.GraphRunner(step, sizes=[4], backend=be, ondemand=True)
    assert "GraphRunner(fn, sizes, backend=None, kind=None" in str(info.value)
    with pytest.raises(hal.InvalidArgumentError, match=r"did you mean sizes\?"):
        graphkit.GraphRunner(step, [4], backend=be, size=[4])


def test_a_report_after_close_is_refused_not_empty(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[4], backend=be, progress=False)
    runner.capture(x=torch.zeros(4, 256))
    runner.close()
    with pytest.raises(hal.InvalidStateError, match="closed"):
        runner.report()


def test_the_word_that_turns_the_switch_on_goes_with_options() -> None:
    from graphkit import switch

    assert switch.parse("yes,verify=1") == switch.Options(verify=True)
    assert switch.parse("on, kind=shared") == switch.Options(kind="shared")


def test_the_header_names_the_granule_a_figure_is_counted_in(be: hal.Backend) -> None:
    with graphkit.GraphPools(be) as pools:
        graph, x = be.create_graph(), torch.zeros(8, 256)
        with be.capture(graph, pool=pools.pool(8)):
            y = step(x)
        assert "of chunks in 64.0 KiB granules" in str(pools.report())
        be.release_graph(graph)
        del y
