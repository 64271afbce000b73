"""aten's in-place, in-place view, view and ``out=`` ops, enumerated from torch's own op lists, with inputs.

The families are read from the op schemas and tags (``torch.Tag.inplace_view``,
the ``(a!)`` write annotations, aliased returns), so a new torch brings its new
ops with it. Inputs are made from the argument types: every required argument
gets a value by its type (and, for ints and int lists, by its name); arguments
with a default keep it. An op whose eager call fails on those inputs is left
out by the caller, which checks that enough of each family ran.

:func:`replays_like_eager` captures a use of one op on the recorder, replays it
on new input values and compares with an eager run on the same values: every
op it accepts must replay exactly as eager does, and one it refuses must be
refused with a :class:`hal.CaptureError` that names an aten op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import hal

aten = torch.ops.aten
SHAPE = (3, 4)
#: the dtypes tried in turn until the op's eager call works
DTYPES = (torch.float32, torch.int64, torch.bool)
#: ops whose results are uninitialised memory: nothing to compare
UNDEFINED_VALUES = ("empty", "new_empty")
INTS = {"dim": 1, "dim0": 0, "dim1": 1, "dimension": 1, "start": 0, "diagonal": 0, "offset": 0, "storage_offset": 0}
INT_LISTS = {"dims": [1, 0], "dim": [1], "size": [4, 3], "shape": [4, 3], "stride": [1, 4]}
NONE_TYPES = ("Optional[", )


class NoValue(Exception):
    """An argument this module cannot make a value for."""


def _written(a: Any) -> bool:
    return a.alias_info is not None and a.alias_info.is_write


def _core(op: Any) -> bool:
    packet = op.overloadpacket
    return any(torch.Tag.core in getattr(packet, name).tags for name in packet.overloads())


@functools.cache
def families() -> dict[str, list[Any]]:
    """``{"inplace_view", "view", "inplace", "out"}`` -> aten op overloads (public names only).

    ``out`` holds the ``out=`` overloads of pointwise ops and of aten's core ops (reductions,
    ``cat``, matrix products...); ops that crash eagerly on made-up inputs live outside those.
    """
    found: dict[str, list[Any]] = {"inplace_view": [], "view": [], "inplace": [], "out": []}
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if name.startswith("_") or not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            writes = [a for a in schema.arguments if _written(a)]
            if torch.Tag.inplace_view in op.tags:
                found["inplace_view"].append(op)
            elif writes and all(a.kwarg_only for a in writes):
                if (torch.Tag.pointwise in op.tags or _core(op)) and not name.startswith(UNDEFINED_VALUES):
                    found["out"].append(op)
            elif writes and _written(schema.arguments[0]):
                found["inplace"].append(op)
            elif not writes and any(r.alias_info is not None for r in schema.returns):
                found["view"].append(op)
    return found


def _tensor(name: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name in ("index", "indices"):
        return torch.randint(0, SHAPE[0], SHAPE, generator=gen)
    if name == "mask" or dtype == torch.bool:
        return torch.rand(SHAPE, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.rand(SHAPE, generator=gen, dtype=dtype) + 0.5
    return torch.randint(1, 5, SHAPE, generator=gen, dtype=dtype)


def _value(a: Any, dtype: torch.dtype, gen: torch.Generator) -> Any:
    kind, name = str(a.type), a.name
    if kind == "Tensor":
        return _tensor(name, dtype, gen)
    if kind.startswith(NONE_TYPES):
        return None
    if kind == "List[Tensor]":
        return [_tensor("x", dtype, gen), _tensor("y", dtype, gen)]
    if kind == "Storage":  # the same values whatever the seed: a capture holds the storage it was given
        return torch.arange(SHAPE[0] * SHAPE[1]).to(dtype).untyped_storage()
    simple = {"number": True if dtype == torch.bool else 2, "int": INTS.get(name, 2),
              "List[int]": INT_LISTS.get(name, [1, 2]), "bool": False, "float": 0.5}
    if kind not in simple:
        raise NoValue(kind)
    return simple[kind]


def sample(op: Any, dtype: torch.dtype, seed: int,
           outs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments for ``op``; ``outs``: ``out=`` tensors of these shapes and dtypes.

    :raises NoValue: an argument of a type this module cannot make.
    """
    gen = torch.Generator().manual_seed(seed)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in op._schema.arguments:
        if a.has_default_value() or (_written(a) and a.kwarg_only):
            continue
        value = _value(a, dtype, gen)
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    for name, (shape, out_dtype) in (outs or {}).items():
        kwargs[name] = (torch.rand(shape, generator=gen) * 4).to(out_dtype)
    return args, kwargs


def out_names(op: Any) -> list[str]:
    return [a.name for a in op._schema.arguments if _written(a) and a.kwarg_only]


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _clone(tree: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def assert_same(got: Any, want: Any) -> None:
    got, want = tensors(got), tensors(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


Use = Callable[[Any, list[Any], dict[str, Any]], Any]


def eager_runs(op: Any, use: Use, outs: Any = None) -> torch.dtype | None:
    """The first dtype of :data:`DTYPES` whose inputs ``use`` runs ``op`` on eagerly, or None."""
    for dtype in DTYPES:
        try:
            args, kwargs = sample(op, dtype, 0, outs)
        except NoValue:
            return None
        try:
            with torch.no_grad():
                use(op, args, kwargs)
        except Exception:  # noqa: BLE001 - made-up inputs that do not suit the op: try the next dtype
            continue
        return dtype
    return None


def replays_like_eager(be: hal.Backend, op: Any, use: Use, dtype: torch.dtype, outs: Any = None) -> bool:
    """Capture ``use(op, args, kwargs)``; False when the capture is refused (with a CaptureError naming an op).

    Otherwise replay on new values written into the inputs (through the layout they had before the capture,
    as a caller writes them) and compare the results and the inputs with an eager run on those values.
    """
    args, kwargs = sample(op, dtype, 0, outs)
    written_through = [t.view(t.shape) for t in tensors((args, kwargs))]
    graph = be.create_graph()
    try:
        torch.random.default_generator.manual_seed(0)
        with torch.no_grad(), be.capture(graph):
            out = use(op, args, kwargs)
    except hal.CaptureError as exc:
        assert "aten." in str(exc), f"{op}: the refusal names no op: {exc}"
        return False
    finally:
        if not graph.captured:
            be.release_graph(graph)
    new_args, new_kwargs = sample(op, dtype, 1, outs)
    for t, new in zip(written_through, tensors((new_args, new_kwargs)), strict=True):
        t.copy_(new)
    torch.random.default_generator.manual_seed(1)
    be.replay(graph)
    torch.random.default_generator.manual_seed(1)
    with torch.no_grad():
        want = use(op, new_args, new_kwargs)
    assert_same((out, args, kwargs), (want, new_args, new_kwargs))
    be.release_graph(graph)
    return True


# -- how the captured functions use an op ------------------------------------------------------


def in_place_on_a_new_tensor(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0].clone()
    op(x, *args[1:], **kwargs)
    return x


def in_place_on_an_input(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    op(*args, **kwargs)
    return args[0] * 1  # read through whatever the op made of the input


def read_views(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    return [t * 1 for t in tensors(op(*args, **kwargs))]


def write_through_a_view(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0].clone()
    tensors(op(x, *args[1:], **kwargs))[0].mul_(3)
    return x


def out_into_an_empty_tensor(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``out=`` tensors made empty inside the capture: torch resizes them."""
    like = next((t.dtype for t in tensors(args)), torch.float32)
    outs = {name: torch.empty(0, dtype=torch.int64 if name in ("indices", "index") else like)
            for name in out_names(op)}
    op(*args, **kwargs, **outs)
    return list(outs.values())


def out_into_inputs(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``out=`` tensors made before the capture (in ``kwargs``), of the right shape."""
    op(*args, **kwargs)
    return []


def out_shapes(op: Any, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each ``out=`` tensor of ``op`` on :func:`sample`'s inputs, as torch sizes them."""
    args, kwargs = sample(op, dtype, 0)
    with torch.no_grad():
        made = out_into_an_empty_tensor(op, args, kwargs)
    return {name: (tuple(t.shape), t.dtype) for name, t in zip(out_names(op), made, strict=True)}
