"""graphkit: capture device graphs for many shapes at the memory cost of the largest, on any hal backend.

An engine adopts it without a changed line: ``with graphkit.graph_memory():`` around its start (every capture
inside draws from a fresh virtual space over physical chunks that all captures share), or
``GRAPHKIT_GRAPH_MEMORY=1`` in the environment of every process it starts. Three options matter:
``outputs`` (``"kept"``: what a capture leaves allocated keeps bytes of its own; ``"replay"``: shared),
``executables`` (``"lazy"``: an executable per graph at its first replay; ``K``: at most K per topology,
updated) and ``verify`` (off). :class:`GraphRunner` captures a step for a list of sizes by itself.

* ``docs/engines.md`` in the repository: a five-minute start, then the port per engine;
* ``docs/executables.md``: the driver's memory of every graph, and the executables budget.
"""

from graphkit import switch
from graphkit.graphs.buffers import StaticInputs
from graphkit.graphs.capture import CaptureHygieneError
from graphkit.graphs.isolation import IsolationError
from graphkit.graphs.pools import GraphPools, PoolHandle, graph_memory
from graphkit.graphs.report import KeyReport, PoolsReport, RunnerReport, SizeReport
from graphkit.graphs.runner import GraphRunner, RunnerOptions
from graphkit.memory.allocator import SharedVMMAllocator
from graphkit.memory.elastic import ElasticBuffer, ElasticReservation
from graphkit.memory.sharing import ExportedRange, ImportedRange
from graphkit.saver import MemorySaver, SaverReport, Sleeper, TagReport
from hal import __version__
from hal.transaction import Transaction

__all__ = [
    "__version__",
    "CaptureHygieneError",
    "ElasticBuffer",
    "ElasticReservation",
    "ExportedRange",
    "GraphPools",
    "GraphRunner",
    "ImportedRange",
    "IsolationError",
    "KeyReport",
    "MemorySaver",
    "PoolHandle",
    "PoolsReport",
    "RunnerOptions",
    "RunnerReport",
    "SaverReport",
    "SharedVMMAllocator",
    "SizeReport",
    "Sleeper",
    "StaticInputs",
    "TagReport",
    "Transaction",
    "graph_memory",
    "switch",
]
