"""Static input buffers: named tensors sized for the largest batch, at fixed addresses.

A graph reads its inputs from the addresses it was captured with. Each call
copies the actual rows into the prefix of these buffers and fills the
padding rows up to the bucket size with a per-input fill value, chosen so
that padding never corrupts state (e.g. a KV-cache slot index that points at
a scratch slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch

import hal

#: the most (batch, padded size) pairs whose buffer views are kept
_MAX_KEPT_ROWS = 4096


class StaticInputs:
    """Buffers of shape ``(max_batch, *row_shape)``, one per named input."""

    def __init__(self, examples: Mapping[str, torch.Tensor], max_batch: int,
                 fill: Mapping[str, Any] | None = None, device: torch.device | None = None) -> None:
        if not examples:
            raise hal.InvalidArgumentError("the step takes no tensor input; give at least one", call="StaticInputs")
        fill = dict(fill or {})
        unknown = set(fill) - set(examples)
        if unknown:
            raise hal.InvalidArgumentError(f"fill names unknown input(s): {', '.join(sorted(unknown))}",
                                           call="StaticInputs")
        self.max_batch = max_batch
        self.fill = {name: fill.get(name, 0) for name in examples}
        self.buffers: dict[str, torch.Tensor] = {}
        for name, ex in examples.items():
            if not isinstance(ex, torch.Tensor) or ex.dim() == 0:
                raise hal.InvalidArgumentError(
                    f"input {name!r} must be a tensor whose dim 0 is the batch, got {type(ex).__name__}"
                    + (f" of shape {tuple(ex.shape)}" if isinstance(ex, torch.Tensor) else ""),
                    call="StaticInputs")
            dev = device or ex.device
            self.buffers[name] = torch.full((max_batch, *ex.shape[1:]), self.fill[name], dtype=ex.dtype, device=dev)
        self.addresses = {name: b.data_ptr() for name, b in self.buffers.items()}
        # what a call's inputs must match, per buffer: checked on every call, so read once here
        self._expected = [(name, b.dtype, b.dim(), b.shape[1:], b.device) for name, b in self.buffers.items()]
        # (batch, padded_to) -> name -> (the buffer's first ``batch`` rows, its rows up to ``padded_to`` or None,
        # the fill): made once per pair, since slicing a tensor costs more than the copy of a small batch
        self._rows: dict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor | None, Any]]] = {}

    def batch_of(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Check the inputs against the buffers; return the common batch size."""
        return self.check(inputs, grad=False)[0]

    def check(self, inputs: Mapping[str, torch.Tensor], grad: bool) -> tuple[int, bool]:
        """Check the inputs against the buffers; the common batch size, and (when ``grad``) whether an input
        requires gradients. The runner's every call goes through here: the common case reads each input once."""
        if len(inputs) != len(self._expected):
            self._refuse(inputs)
        batch, wants_grad = -1, False
        for name, dtype, dim, row, device in self._expected:
            t = inputs.get(name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                self._refuse(inputs)
            shape = t.shape
            if (len(shape) != dim or (dim > 1 and shape[1:] != row) or t.device != device
                    or (batch >= 0 and shape[0] != batch)):
                self._refuse(inputs)
            batch = shape[0]
            if grad and t.requires_grad:
                wants_grad = True
        return batch, wants_grad

    def _refuse(self, inputs: Mapping[str, Any]) -> NoReturn:
        """Raise the error that says what is wrong with ``inputs`` (the slow path of :meth:`batch_of`)."""
        if inputs.keys() != self.buffers.keys():
            missing = sorted(self.buffers.keys() - inputs.keys())
            extra = sorted(inputs.keys() - self.buffers.keys())
            raise hal.InvalidArgumentError(
                "inputs differ from the captured ones"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unexpected: {', '.join(extra)}" if extra else "")
                + f": give each input by the name capture() got, runner({', '.join(f'{n}=...' for n in self.buffers)})",
                call="GraphRunner")
        batch = None
        for name, buf in self.buffers.items():
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise hal.InvalidArgumentError(f"input {name!r} must be a tensor, got {type(t).__name__}",
                                               call="GraphRunner")
            if t.dtype != buf.dtype:
                raise hal.InvalidArgumentError(f"input {name!r} has dtype {t.dtype}, expected {buf.dtype}",
                                               call="GraphRunner")
            if t.dim() != buf.dim() or t.shape[1:] != buf.shape[1:]:
                expected = ", ".join(map(str, buf.shape[1:]))
                raise hal.InvalidArgumentError(
                    f"input {name!r} has shape {tuple(t.shape)}, expected (batch, {expected})", call="GraphRunner")
            if t.device != buf.device:
                raise hal.InvalidArgumentError(f"input {name!r} is on {t.device}, expected {buf.device}",
                                               call="GraphRunner")
            if batch is None:
                batch = t.shape[0]
            elif t.shape[0] != batch:
                raise hal.InvalidArgumentError(
                    f"input {name!r} has batch {t.shape[0]}, others have {batch}", call="GraphRunner")
        raise hal.InvalidArgumentError("inputs differ from the captured ones", call="GraphRunner")

    def update(self, inputs: Mapping[str, torch.Tensor], batch: int, padded_to: int) -> None:
        """Copy ``batch`` rows of every input into the prefix; fill rows ``batch:padded_to``."""
        rows = self._rows.get((batch, padded_to))
        if rows is None:
            rows = self.rows_for(batch, padded_to)
        for name, t in inputs.items():
            prefix, padding, fill = rows[name]
            prefix.copy_(t, True)  # non_blocking
            if padding is not None:
                padding.fill_(fill)

    def rows_for(self, batch: int, padded_to: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, Any]]:
        """The views :meth:`update` writes for ``batch`` rows padded to ``padded_to``, made once and kept."""
        if padded_to > self.max_batch:
            raise hal.InvalidArgumentError(
                f"batch {padded_to} is over the maximum {self.max_batch} the buffers were sized for",
                call="GraphRunner")
        if len(self._rows) >= _MAX_KEPT_ROWS:  # a bound, for callers that pass many distinct pairs
            self._rows.clear()
        rows = {name: (buf[:batch], buf[batch:padded_to] if padded_to > batch else None, self.fill[name])
                for name, buf in self.buffers.items()}
        self._rows[(batch, padded_to)] = rows
        return rows

    def views(self, batch: int) -> dict[str, torch.Tensor]:
        """The first ``batch`` rows of every buffer."""
        return {name: buf[:batch] for name, buf in self.buffers.items()}

    def moved(self) -> list[str]:
        """Names of buffers whose address is no longer the one captured (should be empty)."""
        return [n for n, b in self.buffers.items() if b.data_ptr() != self.addresses[n]]
