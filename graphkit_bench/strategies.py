"""The memory strategies the bench compares, each configured the way the engines do it."""

from __future__ import annotations

from typing import Any, Literal

#: name -> GraphRunner options. The engines' own ways instantiate every graph at the end of its capture
#: (``executables=None``); graphkit's keeps its default executables budget.
STRATEGIES: dict[str, dict[str, Any]] = {
    # a pool per graph: torch's default for torch.cuda.graph without pool=
    "private": {"kind": "private", "executables": None},
    # one pool, largest first, the runner keeps every graph's outputs (SGLang, nano-vllm)
    "shared-kept": {"kind": "shared", "keep_outputs": "strong", "executables": None},
    # one pool, largest first, outputs held by non-owning references (vLLM)
    "shared-weakref": {"kind": "shared", "keep_outputs": "weak", "executables": None},
    # a fresh virtual space per capture over one set of physical chunks, its default executables (graphkit)
    "vmm": {"kind": "vmm"},
}

ORDERS = ("descending", "ascending", "random", "on-demand")
#: the orders GraphRunner captures in (``on-demand`` is the bench's own: a size when a batch first needs it)
Order = Literal["descending", "ascending", "random"]

COMPILE = "torch.compile"
"""torch.compile(mode="reduce-overhead"): torch's own graph trees, measured where it fits in time."""

#: the row of ``--every-size``: vmm over every batch size 1..the largest, largest first
EVERY_SIZE = "every-size"

DESCRIPTIONS = {
    "private": "a pool per graph (torch default)",
    "shared-kept": "one pool, outputs kept (SGLang, nano-vllm)",
    "shared-weakref": "one pool, outputs weakly referenced (vLLM)",
    "vmm": "fresh virtual space per capture over shared chunks (graphkit)",
    COMPILE: 'torch.compile(mode="reduce-overhead")',
}
