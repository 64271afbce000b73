"""Routing every capture of the process, whatever its backend and device: what graphkit's switch uses.

A router given to :func:`route_every_capture` is asked, as
``router(backend, device, graph, requested_pool)``, for every capture that no
router of its device takes (:meth:`hal.Backend.route_captures`): captures the
framework starts (``torch.cuda.graph``, ``torch.npu.graph``...) and captures
through :meth:`hal.Backend.capture` of any backend. It may return a
:class:`hal.types.Route` or None, as a device's router does.

The frameworks' graph classes are patched only while such a router is
active, and only those of extensions imported already: call
:func:`patch_imported` again once a later one is imported (torch_npu, say).
Nothing here opens a device or initialises a driver. The choice of a
capture's route (a device's routers, then the process's) is
:mod:`hal.routing`'s.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from hal.routing import ProcessRouter, add_process_router, remove_process_router

#: the built-in backends over a torch extension, and the module of their torch glue
FRAMEWORKS = (("cuda", "hal.backends.cuda.torch_glue"), ("ascend", "hal.backends.ascend.torch_glue"),
              ("mlu", "hal.backends.mlu.torch_glue"))


def patch_imported() -> list[str]:
    """Route the captures of every framework graph class whose extension is imported now; the backends' names."""
    found = []
    for name, module in FRAMEWORKS:
        if importlib.import_module(module).EXTENSION.class_routing(name) is not None:
            found.append(name)
    return found


@contextlib.contextmanager
def route_every_capture(router: ProcessRouter) -> Iterator[None]:
    """Inside the block, ``router`` is asked for every capture of the process that no device's router takes."""
    add_process_router(router)
    try:
        patch_imported()
        yield
    finally:
        remove_process_router(router)


__all__ = ["FRAMEWORKS", "ProcessRouter", "patch_imported", "route_every_capture"]
