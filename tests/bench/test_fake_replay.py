"""The fake backend's compiled replay: equal to eager, in the same memory, whichever path an op takes.

A replay runs a program compiled at the end of the capture: ops write
their results straight into the placed memory through their ``out=``
overloads where they have one, and run as recorded and copy otherwise.
These tests compare replays against eager runs on inputs written into the
static inputs, and would catch a wrong fast path: an output written
elsewhere, an in-place chain or a view broken, an out overload that
disagrees with its functional op, an output overlapping an input.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import graphkit
import hal
from graphkit.graphs.capture import weak_alias
from graphkit_bench.fakereplay import SmallOpModel
from graphkit_bench.model import Decoder, DecoderConfig
from tests import op_families


def capture(be: hal.Backend, fn: Callable[..., Any], *args: Any, pool: Any = None,
            grad: bool = False) -> tuple[Any, Any]:
    """One warm-up call, then a capture of ``fn(*args)``: the graph and its outputs."""
    with torch.set_grad_enabled(grad):
        fn(*args)
        graph = be.create_graph()
        with be.capture(graph, pool=pool):
            out = fn(*args)
    return graph, out


def leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def assert_same(got: Any, want: Any) -> None:
    """Bitwise equal, leaf by leaf (the replay runs the kernels eager runs)."""
    got, want = leaves(got), leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g - w).abs().max() if g.is_floating_point() else (g, w)


def addresses(tree: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    return [(t.data_ptr(), tuple(t.shape), t.stride()) for t in leaves(tree)]


class OpLog(TorchDispatchMode):
    """The aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


# -- whole models --------------------------------------------------------------------------


def test_small_op_model_replays_like_eager_in_place(be: hal.Backend) -> None:
    model = SmallOpModel()
    x = torch.randn(4, 64)
    graph, out = capture(be, model.step, x)
    where = addresses(out)
    for seed in range(4):
        x.copy_(torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        with torch.no_grad():
            assert_same(out, model.step(x))
        assert addresses(out) == where  # the same memory, shape and strides as captured
    be.release_graph(graph)


def test_small_op_model_replays_without_allocating_or_copying(be: hal.Backend) -> None:
    """Every op of the 16-layer model has an out= overload: a replay writes in place, copies nothing."""
    model = SmallOpModel()
    x = torch.randn(4, 64)
    graph, out = capture(be, model.step, x)
    with OpLog() as seen:
        be.replay(graph)
    assert seen.ops and all(op._schema.is_mutable for op in seen.ops), sorted({str(op) for op in seen.ops})
    assert torch.ops.aten.copy_.default not in seen.ops
    with torch.no_grad():
        assert_same(out, model.step(x))
    be.release_graph(graph)


@pytest.mark.parametrize("batch", [1, 3])
def test_demo_step_replays_like_eager(be: hal.Backend, batch: int) -> None:
    model = Decoder(DecoderConfig.tiny(), max_batch=4, device=be.torch_device())
    static = model.example_inputs(batch, seed=0)
    graph, logits = capture(be, lambda: model.step(**static))
    for seed in range(1, 5):
        for name, value in model.example_inputs(batch, seed=seed).items():
            static[name].copy_(value)
        model.reset_cache()
        be.replay(graph)
        got = (logits.clone(), model.k_cache.clone(), model.v_cache.clone())
        model.reset_cache()
        with torch.no_grad():
            want = (model.step(**static), model.k_cache.clone(), model.v_cache.clone())
        assert_same(got, want)
    be.release_graph(graph)


def test_demo_step_through_the_runner(be: hal.Backend) -> None:
    model = Decoder(DecoderConfig.tiny(), max_batch=4, device=be.torch_device())
    with graphkit.GraphRunner(model.step, [1, 2, 4], backend=be, fill=model.padding(), progress=False) as runner:
        runner.capture(**model.example_inputs(4, seed=0))
        for batch, seed in ((1, 1), (3, 2), (4, 3), (2, 4)):
            inputs = model.example_inputs(batch, seed=seed)
            model.reset_cache()
            got = runner(**inputs)
            model.reset_cache()
            with torch.no_grad():
                want = model.step(**inputs)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_modules_with_parameters_that_require_grad(be: hal.Backend) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                              torch.nn.Linear(32, 8))
    x = torch.randn(5, 16)
    graph, out = capture(be, net, x, grad=True)  # captured with autograd on, as a user may
    for seed in range(3):
        x.copy_(torch.randn(5, 16, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        with torch.no_grad():
            assert_same(out.detach(), net(x))
    be.release_graph(graph)


# -- op by op ------------------------------------------------------------------------------


def test_in_place_chains(be: hal.Backend) -> None:
    x = torch.randn(4, 8)
    acc = torch.zeros(4, 8)

    def step(x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        y.add_(1).mul_(x).relu_()
        y.sub_(0.25)
        acc.add_(y)  # a tensor made before the capture: every replay adds again, as every eager call does
        z = y.clone()
        z.clamp_(min=0.1).mul_(z)
        w = x.exp()
        w.div_(w.sum(dim=1, keepdim=True))
        return y, z, w

    graph, out = capture(be, step, x, acc)
    ref_acc = acc.clone()
    for seed in range(4):
        x.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        with torch.no_grad():
            want = step(x, ref_acc)
        assert_same(out, want)
        assert_same(acc, ref_acc)
    be.release_graph(graph)


def test_views_of_outputs_stay_views(be: hal.Backend) -> None:
    x = torch.randn(4, 4)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x @ x.t() + 1
        return y, y[1:], y.t(), y.view(-1)[::3], y.diagonal(), y.unsqueeze(0).expand(2, 4, 4)

    graph, out = capture(be, step, x)
    mine = out[0][:, :2]  # a view the caller takes after the capture
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)
    for seed in range(3):
        x.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        with torch.no_grad():
            want = step(x)
        assert_same(out, want)
        assert_same(mine, want[0][:, :2])
    be.release_graph(graph)


def test_ops_with_out(be: hal.Backend) -> None:
    x = torch.randn(4, 8)
    ext = torch.empty(4, 8)  # outside the graph's pool

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tmp = torch.empty(4, 8)
        torch.mul(x, 3, out=tmp)
        torch.add(tmp, x, out=ext)
        s = torch.empty(4)
        torch.sum(ext, dim=1, out=s)
        values, indices = torch.empty(4), torch.empty(4, dtype=torch.long)
        torch.max(tmp, dim=1, out=(values, indices))
        return tmp, s, values, indices

    graph, out = capture(be, step, x)
    ext_before = ext.data_ptr()
    for seed in range(3):
        x.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        got = (*out, ext.clone())
        with torch.no_grad():
            want = step(x)
        assert_same(got, (*want, ext))
        assert ext.data_ptr() == ext_before
    be.release_graph(graph)


def test_several_outputs_dtypes_and_layouts(be: hal.Backend) -> None:
    x = torch.randn(6, 8)
    i = torch.randint(-5, 5, (6, 8), dtype=torch.int32)

    def step(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, idx = x.max(dim=1)
        var, mean = torch.var_mean(x, dim=0)
        srt, order = x.sort(dim=1)
        return (values, idx, var, mean, srt, order, x > 0, i.sum(), i * 0.5, i // 2, x.to(torch.float64),
                F.layer_norm(x, (8,)), F.softmax(x, -1), x.t().clone(), x.t().contiguous() * 1,
                torch.cat([x, x]), torch.stack([x, x], dim=1), torch.where(x > 0, x, i), x[i.abs() % 6, 0],
                torch.einsum("ij,kj->ik", x, x), x.cumsum(0), x.abs().sqrt(), x.argmax(1), x.mean(),
                x.norm(dim=1), torch.topk(x, 3, dim=1).values)

    graph, out = capture(be, step, x, i)
    where = addresses(out)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(6, 8, generator=gen))
        i.copy_(torch.randint(-5, 5, (6, 8), generator=gen, dtype=torch.int32))
        be.replay(graph)
        with torch.no_grad():
            assert_same(out, step(x, i))
        assert addresses(out) == where
    be.release_graph(graph)


def test_factory_ops_run_again_on_every_replay(be: hal.Backend) -> None:
    x = torch.randn(4)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buf = torch.zeros(4)
        buf.add_(x)  # would accumulate if the zeros were not made again
        ramp = torch.arange(4) * x
        full = torch.full((4,), 2.0)
        full.mul_(x)
        return buf, ramp, full, torch.ones_like(x).add_(x), x.new_zeros(4).sub_(x)

    graph, out = capture(be, step, x)
    for _ in range(3):
        be.replay(graph)
        with torch.no_grad():
            assert_same(out, step(x))
    be.release_graph(graph)


def test_random_ops_draw_like_eager(be: hal.Backend) -> None:
    x = torch.randn(64)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x + torch.rand_like(x), F.dropout(x, 0.5, training=True), torch.randn(8) * x[:8]

    graph, out = capture(be, step, x)
    seen = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        be.replay(graph)
        seen.append(out[0].clone())
        torch.manual_seed(seed)
        with torch.no_grad():
            assert_same(out, step(x))
    assert not torch.equal(seen[0], seen[1])  # every replay draws new numbers
    be.release_graph(graph)


def test_an_output_placed_over_its_own_input(be: hal.Backend) -> None:
    """A weak alias into a shared pool can be an input whose memory the pool hands to the op's output.

    Writing such an output through ``out=`` would read inputs already overwritten; the replay
    must compute first and copy after, as the capture did.
    """
    pool = be.create_pool()
    x = torch.randn(4, 4)
    first, y = capture(be, lambda x: x * 2, x, pool=pool)
    w = weak_alias(y)  # how vLLM holds outputs: the pool may reuse the memory
    del y
    gc.collect()
    second, z = capture(be, lambda w: w @ w, w, pool=pool)
    assert z.data_ptr() == w.data_ptr()  # the precondition: the output lies over the input
    for seed in range(3):
        x.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)))
        be.replay(first)
        want = w.clone() @ w.clone()
        be.replay(second)
        assert_same(z, want)
    for graph in (first, second):
        be.release_graph(graph)
    del w, z
    gc.collect()
    be.release_pool(pool)


def test_replay_memory_stays_in_place(be: hal.Backend) -> None:
    """A replay takes nothing from the graph's pool, and leaves nothing in a pool used around it."""
    pool, other = be.create_pool(), be.create_pool()
    x = torch.randn(4, 8)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
        return (x * 2).relu(), q, torch.rand_like(x)  # out= ops, an op without out=, a random op

    graph, out = capture(be, step, x, pool=pool)
    blocks = be.pool_active_blocks(pool)
    assert blocks
    with be.use_pool(other):
        be.replay(graph)
    be.replay(graph)
    assert be.pool_active_blocks(pool) == blocks
    assert be.pool_active_blocks(other) == []
    be.release_graph(graph)
    del out
    gc.collect()
    for p in (pool, other):
        be.release_pool(p)


def test_errors_are_unchanged(be: hal.Backend) -> None:
    graph = be.create_graph()
    with pytest.raises(hal.InvalidStateError, match="never captured"):
        be.replay(graph)
    with pytest.raises(hal.CaptureError):
        with be.capture(graph):
            (torch.ones(3) * 2).sum().item()
    be.release_graph(graph)


# -- what a tensor shows changes in place ------------------------------------------------------------


@pytest.mark.parametrize("change", [
    lambda x: x.t_(), lambda x: x.transpose_(0, 1), lambda x: x.swapdims_(0, 1), lambda x: x.swapaxes_(1, 0),
    lambda x: x.unsqueeze_(1), lambda x: x.unsqueeze_(0).squeeze_(0), lambda x: x.as_strided_((4, 8), (1, 4)),
    lambda x: x.resize_(16, 2), lambda x: x.resize_(4, 4)],
    ids=["t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_", "as_strided_", "resize_",
         "resize_smaller"])
def test_an_in_place_view_op_on_an_input_replays_through_the_new_view(be: hal.Backend,
                                                                      change: Callable[..., Any]) -> None:
    x = torch.randn(8, 4)
    as_written = x.view(8, 4)  # how the caller writes new inputs: the layout x had before the capture
    graph = be.create_graph()
    with torch.no_grad(), be.capture(graph):
        change(x)
        out = x * 2 + x.sum(0)
    shown = (x.shape, x.stride())
    for seed in range(3):
        new = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
        as_written.copy_(new)
        be.replay(graph)
        want = new.clone()
        change(want)
        assert_same(out, want * 2 + want.sum(0))
        assert (x.shape, x.stride()) == shown, "the replay changed the input's view again"
    be.release_graph(graph)


def test_resize_inside_a_capture_replays_the_live_memory(be: hal.Backend) -> None:
    x = torch.randn(8, 16)
    graph = be.create_graph()
    with torch.no_grad(), be.capture(graph):
        y = x.clone()
        y.resize_(16, 8)
        out = y * 1
        z = x[0].clone()
        z.resize_(2, 4)
        out2 = z + 1
    for seed in range(3):
        x.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        assert_same((out, out2), (x.reshape(16, 8), x[0, :8].reshape(2, 4) + 1))
    be.release_graph(graph)


@pytest.mark.parametrize("made", ["inside", "before"])
def test_out_into_an_empty_tensor_lands_in_the_pool_and_replays(be: hal.Backend, made: str) -> None:
    x = torch.randn(8, 16)
    outside = torch.empty(0)
    pool = be.create_pool()
    graph = be.create_graph()
    with torch.no_grad(), be.capture(graph, pool=pool):
        o = torch.empty(0) if made == "inside" else outside
        torch.mul(x, 2, out=o)
        c = torch.empty(0)
        torch.cat([x, o], out=c)
    assert any(p <= o.data_ptr() < p + n for p, n in be.pool_active_blocks(pool)), "o's memory is not the pool's"
    for seed in range(3):
        x.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)))
        be.replay(graph)
        assert_same((o, c), (x * 2, torch.cat([x, x * 2])))
    be.release_graph(graph)
    del o, c, outside
    gc.collect()
    be.release_pool(pool)


def test_growing_a_tensor_the_replay_cannot_follow_is_refused_by_name(be: hal.Backend) -> None:
    x = torch.randn(4)
    before = torch.randn(2)
    for grow in (lambda: (x * 1).resize_(8), lambda: torch.mul(x, 2, out=before), lambda: before.resize_(16)):
        graph = be.create_graph()
        with pytest.raises(hal.CaptureError, match=r"aten\.\w+") as info:
            with torch.no_grad(), be.capture(graph):
                grow()
        assert info.value.backend == "fake" and info.value.call == "capture"
        be.release_graph(graph)


# -- op families, enumerated from aten's op lists ------------------------------------------------


FAMILY_USES = {
    "inplace_view": (op_families.in_place_on_a_new_tensor, op_families.in_place_on_an_input),
    "inplace": (op_families.in_place_on_a_new_tensor, op_families.in_place_on_an_input),
    "view": (op_families.read_views, op_families.write_through_a_view),
}


@pytest.mark.parametrize("family, at_least", [("inplace_view", 16), ("inplace", 300), ("view", 60)])
def test_every_op_of_a_family_replays_like_eager_or_is_refused_by_name(be: hal.Backend, family: str,
                                                                      at_least: int) -> None:
    ran, failed = 0, []
    for op in op_families.families()[family]:
        for use in FAMILY_USES[family]:
            dtype = op_families.eager_runs(op, use)
            if dtype is None:  # made-up inputs that do not suit the op
                continue
            try:
                ran += op_families.replays_like_eager(be, op, use, dtype)
            except Exception as exc:  # noqa: BLE001 - every op's failure is listed
                failed.append(f"{op} {use.__name__}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
    assert ran >= at_least, f"only {ran} {family} uses replayed: the inputs suit fewer ops than they did"


def test_every_out_op_replays_like_eager_or_is_refused_by_name(be: hal.Backend) -> None:
    ran, failed = 0, []
    for op in op_families.families()["out"]:
        dtype = op_families.eager_runs(op, op_families.out_into_an_empty_tensor)
        if dtype is None:
            continue
        outs = op_families.out_shapes(op, dtype)
        for use, given in ((op_families.out_into_an_empty_tensor, None), (op_families.out_into_inputs, outs)):
            try:
                ran += op_families.replays_like_eager(be, op, use, dtype, given)
            except Exception as exc:  # noqa: BLE001 - every op's failure is listed
                failed.append(f"{op} {use.__name__}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
    assert ran >= 450, f"only {ran} out= uses replayed: the inputs suit fewer ops than they did"
