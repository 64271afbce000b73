"""How a :class:`graphkit.GraphRunner` hands a replay's outputs to its caller: copies, static buffers or views."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

OutputMode = Literal["copy", "static", "view"]


class Layout:
    """The leaves of one bucket's outputs (those of its last piece), read once: a call only slices them.

    :attr:`single` is the output itself when it is one tensor (the common case, handled without pytree).
    """

    __slots__ = ("batched", "leaves", "single", "spec")

    def __init__(self, out: Any, size: int) -> None:
        self.leaves, self.spec = tree_flatten(out)
        # a leaf is sliced to the batch when it is a tensor whose dim 0 is the bucket's size
        self.batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size for t in self.leaves]
        self.single = out if isinstance(out, torch.Tensor) else None


class Outputs:
    """The batch's rows of a replay's outputs, in the runner's output mode.

    ``"copy"``: fresh tensors that belong to the caller; ``"static"``:
    buffers of the runner sized for the largest batch, valid until its next
    call; ``"view"``: views into the graph's memory, valid until the next
    replay of any graph of the pool.
    """

    def __init__(self, mode: OutputMode, max_size: int) -> None:
        self.mode = mode
        self.max_size = max_size
        self._static: list[torch.Tensor | None] | None = None  # None: a leaf that is no batched tensor

    def deliver(self, layout: Layout, batch: int) -> Any:
        """The first ``batch`` rows of every leaf of a bucket's outputs (read as ``layout``) that has the
        bucket's size in rows; other leaves as they are."""
        single = layout.single
        if single is not None and self.mode != "static":  # one tensor: no pytree on the way
            view = single[:batch] if layout.batched[0] else single
            return view if self.mode == "view" else view.clone()
        rows = [t[:batch] if sliced else t for t, sliced in zip(layout.leaves, layout.batched, strict=True)]
        if self.mode == "view":
            return tree_unflatten(rows, layout.spec)
        if self.mode == "copy":
            return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in rows], layout.spec)
        return tree_unflatten(self._into_static(layout.leaves, rows), layout.spec)

    def _into_static(self, leaves: list[Any], rows: list[Any]) -> list[Any]:
        """``rows`` copied into the runner's static buffers (made at the first call from ``leaves``)."""
        if self._static is None:
            self._static = [torch.empty((self.max_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
                            if isinstance(t, torch.Tensor) and t.dim() else None for t in leaves]
        result = []
        for buf, t in zip(self._static, rows, strict=False):
            if buf is None:
                result.append(t.clone() if isinstance(t, torch.Tensor) else t)
            else:
                buf[: t.shape[0]].copy_(t)
                result.append(buf[: t.shape[0]])
        return result

    def drop(self) -> None:
        """Forget the static buffers (the runner closed)."""
        self._static = None
