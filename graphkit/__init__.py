"""graphkit: capture device graphs for many shapes at the memory cost of the largest, on any hal backend."""

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
from graphkit.memory.transaction import Transaction
from graphkit.saver import MemorySaver, SaverReport, Sleeper, TagReport
from hal import __version__

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
