"""Static input buffers: named tensors sized for the largest batch, at fixed addresses.

A graph reads its inputs from the addresses it was captured with. Each call
copies the actual rows into the prefix of these buffers and fills the
padding rows up to the bucket size with a per-input fill value, chosen so
that padding never corrupts state (e.g. a KV-cache slot index that points at
a scratch slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import hal


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

    def batch_of(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Check the inputs against the buffers; return the common batch size."""
        if inputs.keys() != self.buffers.keys():
            missing = sorted(self.buffers.keys() - inputs.keys())
            extra = sorted(inputs.keys() - self.buffers.keys())
            raise hal.InvalidArgumentError(
                "inputs differ from the captured ones"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unexpected: {', '.join(extra)}" if extra else ""), call="GraphRunner")
        batch = None
        for name, t in inputs.items():
            buf = self.buffers[name]
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
        assert batch is not None
        return batch

    def update(self, inputs: Mapping[str, torch.Tensor], batch: int, padded_to: int) -> None:
        """Copy ``batch`` rows of every input into the prefix; fill rows ``batch:padded_to``."""
        if padded_to > self.max_batch:
            raise hal.InvalidArgumentError(
                f"batch {padded_to} is over the maximum {self.max_batch} the buffers were sized for",
                call="GraphRunner")
        for name, t in inputs.items():
            buf = self.buffers[name]
            buf[:batch].copy_(t, non_blocking=True)
            if padded_to > batch:
                buf[batch:padded_to].fill_(self.fill[name])

    def views(self, batch: int) -> dict[str, torch.Tensor]:
        """The first ``batch`` rows of every buffer."""
        return {name: buf[:batch] for name, buf in self.buffers.items()}

    def moved(self) -> list[str]:
        """Names of buffers whose address is no longer the one captured (should be empty)."""
        return [n for n, b in self.buffers.items() if b.data_ptr() != self.addresses[n]]
