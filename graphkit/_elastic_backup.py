"""The host copy an elastic buffer made with ``backup=True`` keeps of its bytes while it sleeps."""

from __future__ import annotations

import torch

import hal


class HostBackup:
    """A host copy of the start of a range (pinned where the device is not the host), reused from sleep to sleep.

    :attr:`held` says whether it holds the current sleep's bytes.
    """

    __slots__ = ("_host", "_woke_held", "held")

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self.held = False
        self._woke_held = False  # what held was when the last sleep ended

    def wake(self) -> None:
        """The sleep ended: the next pause backs up afresh (:meth:`sleep_again` undoes this)."""
        self._woke_held, self.held = self.held, False

    def sleep_again(self) -> None:
        """Back to the sleep :meth:`wake` ended (a failed resume rolled back): it holds that sleep's bytes again."""
        self.held = self._woke_held

    def save(self, backend: hal.Backend, ptr: int, size: int) -> None:
        """Copy ``size`` bytes at ``ptr`` to the host and wait for the copy."""
        pin = backend.torch_device().type != "cpu"
        if self._host is None or self._host.numel() < size:
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self._host[:size].copy_(backend.tensor_at(ptr, size), non_blocking=pin)
        backend.synchronize()
        self.held = True

    def restore(self, backend: hal.Backend, ptr: int, size: int) -> None:
        """Copy the saved bytes back to ``ptr`` and wait for the copy (:attr:`held` stays as it is)."""
        assert self._host is not None, "restore() before save()"
        backend.tensor_at(ptr, size).copy_(self._host[:size], non_blocking=True)
        backend.synchronize()
