"""GraphRunner's options: one dataclass, keywords as overrides, inputs that share a name with a keyword."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphkit
import hal
from graphkit import GraphRunner, RunnerOptions


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def test_options_object_and_keyword_overrides_agree(be: hal.Backend) -> None:
    opts = RunnerOptions(outputs="view", progress=False)
    with GraphRunner(step, [2, 4], be, options=opts) as a, \
            GraphRunner(step, [2, 4], be, outputs="view", progress=False) as b:
        assert a.options == b.options == opts
        x = torch.randn(3, 8)
        a.capture(x=torch.zeros(4, 8))
        b.capture(x=torch.zeros(4, 8))
        torch.testing.assert_close(a(x=x), b(x=x))
        assert a(x=x).data_ptr() != x.data_ptr()


def test_keywords_win_over_the_options_object(be: hal.Backend) -> None:
    with GraphRunner(step, [2], be, options=RunnerOptions(on_demand=True), on_demand=False, progress=False) as r:
        assert r.options.on_demand is False and r.on_demand is False


def test_an_unknown_option_is_named(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="outptus"):
        GraphRunner(step, [2], be, outptus="view")


def test_a_bad_warmup_is_named(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match="warmup"):
        GraphRunner(step, [2], be, warmup=-1)


def test_options_are_frozen_and_replaceable() -> None:
    opts = RunnerOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.mode = "none"  # type: ignore[misc]
    assert dataclasses.replace(opts, mode="none").mode == "none" and opts.mode == "full"


def test_a_model_input_named_order_is_not_taken_for_the_capture_order(be: hal.Backend) -> None:
    def ranked(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return x * order

    with GraphRunner(ranked, [2, 4], be, progress=False) as r:
        r.capture({"order": torch.ones(4, 1)}, x=torch.zeros(4, 8), order="ascending")
        assert r.captured_sizes == [2, 4]
        x, order = torch.randn(3, 8), torch.randn(3, 1)
        torch.testing.assert_close(r(x=x, order=order), x * order)


def test_an_input_given_twice_is_refused(be: hal.Backend) -> None:
    with GraphRunner(step, [2], be, progress=False) as r:
        with pytest.raises(hal.InvalidArgumentError, match="x"):
            r.capture({"x": torch.zeros(2, 8)}, x=torch.zeros(2, 8))
        with pytest.raises(hal.InvalidArgumentError, match="mapping"):
            r.capture([torch.zeros(2, 8)])  # type: ignore[arg-type]


def test_the_common_call_stays_one_line(be: hal.Backend) -> None:
    runner = graphkit.GraphRunner(step, sizes=[1, 2, 4], backend=be)
    runner.capture(x=torch.zeros(4, 8))
    torch.testing.assert_close(runner(x=torch.ones(3, 8)), step(torch.ones(3, 8)))
    runner.close()


def test_a_pool_strategy_of_ones_own_serves_the_runner_through_its_pools(be: hal.Backend) -> None:
    from graphkit.graphs.strategies import Lease, PoolStrategy

    calls: list[str] = []

    class Counting(PoolStrategy):
        kind = "counting"

        def lease(self) -> Lease:
            calls.append("lease")
            return Lease(pool=self.backend.create_pool())

        def give_back(self, lease: Lease) -> None:
            calls.append("give_back")
            self.backend.release_pool(lease.pool)

        def settle(self) -> None:
            calls.append("settle")

        def close(self) -> None:
            calls.append("close")

    strategy = Counting(be)
    runner = GraphRunner(step, [2, 4], be, pool_strategy=strategy, progress=False)
    assert runner.strategy is strategy and runner.pools.strategy is strategy and runner.kind == "counting"
    runner.capture(x=torch.zeros(4, 8))
    assert calls.count("lease") == 2 and runner.pools.keys == [4, 2]
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner(x=x), step(x))
    runner.release_size(2)
    assert calls.count("give_back") == 1 and runner.pools.keys == [4]
    runner.close()
    assert calls.count("give_back") == 2 and calls[-1] == "close" and be.live.zero, be.live


def test_a_pool_strategy_is_a_protocol_an_object_of_ones_own_serves_without_subclassing(be: hal.Backend) -> None:
    from graphkit.graphs.strategies import Lease, PoolStrategy

    class Duck:  # no base class: the members the runner's pools use
        kind, allocator = "duck", None

        def __init__(self, backend: hal.Backend) -> None:
            self.backend, self.pools = backend, []

        def lease(self) -> Lease:
            self.pools.append(self.backend.create_pool())
            return Lease(pool=self.pools[-1])

        def give_back(self, lease: Lease) -> None:
            self.backend.release_pool(lease.pool)

        def settle(self) -> None: ...

        def close(self) -> None: ...

        def figures(self) -> dict[str, int]:
            return {}

    duck = Duck(be)
    assert isinstance(duck, PoolStrategy)
    runner = GraphRunner(step, [2, 4], be, pool_strategy=duck, progress=False)
    runner.capture(x=torch.zeros(4, 8))
    assert runner.kind == "duck" and len(duck.pools) == 2 and runner.pools.allocator is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner(x=x), step(x))
    runner.close()


# -- misuse: each gives a hal error that names the argument and the fix ------------------------------------------


def test_a_backend_name_instead_of_a_backend_says_to_get_one() -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"backend='fake' must be a hal.Backend: pass "
                                                       r"hal.get_backend\('fake'\)"):
        GraphRunner(step, [2], backend="fake")  # type: ignore[arg-type]


def test_one_size_instead_of_a_list_shows_the_list(be: hal.Backend) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=r"sizes=8 must be a list of batch sizes to capture, e.g. "
                                                       r"sizes=\[8\]"):
        GraphRunner(step, 8, be)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fn", "fill", "match"), [
    (None, None, "fn=None must be a callable: the step to capture"),
    (step, 5, r"fill=5 must be a mapping of input name to the value .* e.g. fill=\{'tokens': 0\}"),
])
def test_a_step_or_fill_of_the_wrong_kind_is_refused_at_construction(be: hal.Backend, fn: object, fill: object,
                                                                     match: str) -> None:
    with pytest.raises(hal.InvalidArgumentError, match=match):
        GraphRunner(fn, [2], be, fill=fill, progress=False)  # type: ignore[arg-type]
    assert be.live.zero


def test_a_positional_call_says_to_name_the_inputs(be: hal.Backend) -> None:
    with GraphRunner(step, [2], be, progress=False) as runner:
        runner.capture(x=torch.zeros(2, 8))
        with pytest.raises(hal.InvalidArgumentError, match=r"1 positional argument\(s\): a GraphRunner takes its "
                                                           r"inputs by name, as capture\(\) got them: runner\(x=...\)"):
            runner(torch.ones(2, 8))


def test_a_wrong_input_name_is_named_before_any_capture_and_at_a_call(be: hal.Backend) -> None:
    with GraphRunner(step, [2], be, progress=True) as runner:  # the progress bar is on: the error is not from it
        with pytest.raises(hal.InvalidArgumentError, match=r"the example inputs y do not fit 'step' .*its inputs: "
                                                           r"x\): name each example as the step's parameter"):
            runner.capture(y=torch.zeros(2, 8))
        assert runner.captured_sizes == [] and runner.inputs is None
        runner.capture(x=torch.zeros(2, 8))
        with pytest.raises(hal.InvalidArgumentError, match=r"missing: x; unexpected: y: give each input by the name "
                                                           r"capture\(\) got, runner\(x=...\)"):
            runner(y=torch.ones(2, 8))


def test_a_second_capture_captures_what_is_missing_or_says_why_not(be: hal.Backend,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with GraphRunner(step, [2, 4], be, progress=False) as runner:
        runner.capture(x=torch.zeros(4, 8))
        with caplog.at_level("WARNING", logger="graphkit.graphs.runner"):
            runner.capture(x=torch.zeros(4, 8))
            runner.capture(x=torch.zeros(4, 8))  # said once
        said = [r.getMessage() for r in caplog.records if r.name == "graphkit.graphs.runner"]
        assert len(said) == 1 and "every size (2, 4) has its graph already, so nothing is captured" in said[0], said
        runner.release_size(2)
        runner.capture(x=torch.zeros(4, 8))  # what is missing is captured again
        assert sorted(runner.captured_sizes) == [2, 4]
        with pytest.raises(hal.InvalidArgumentError, match=r"expected \(batch, 8\): a second capture\(\) reuses the "
                                                           "static buffers"):
            runner.capture(x=torch.zeros(4, 5))
