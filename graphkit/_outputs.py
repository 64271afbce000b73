"""How a :class:`graphkit.GraphRunner` hands a replay's outputs to its caller: copies, static buffers or views."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

OutputMode = Literal["copy", "static", "view"]


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

    def deliver(self, out: Any, batch: int, size: int) -> Any:
        """The first ``batch`` rows of every leaf of ``out`` with ``size`` rows; other leaves as they are."""
        leaves, spec = tree_flatten(out)
        rows = [t[:batch] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t
                for t in leaves]
        if self.mode == "view":
            return tree_unflatten(rows, spec)
        if self.mode == "copy":
            return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in rows], spec)
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
        return tree_unflatten(result, spec)

    def drop(self) -> None:
        """Forget the static buffers (the runner closed)."""
        self._static = None
