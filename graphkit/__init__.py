"""graphkit: capture device graphs for many shapes at the memory cost of the largest, on any hal backend."""

from graphkit.allocator import SharedVMMAllocator
from graphkit.buffers import StaticInputs
from graphkit.capture import CaptureHygieneError
from graphkit.elastic import ElasticBuffer, ElasticReservation
from graphkit.graph_pools import GraphPools, PoolHandle, graph_memory
from graphkit.isolation import IsolationError
from graphkit.report import KeyReport, PoolsReport, RunnerReport, SizeReport
from graphkit.runner import GraphRunner, RunnerOptions
from graphkit.saver import MemorySaver, Sleeper, TagReport
from graphkit.sharing import ExportedRange, ImportedRange
from graphkit.transaction import Transaction
from hal import __version__


def __getattr__(name: str) -> object:
    if name == "ElasticPool":  # the old name of ElasticReservation
        from graphkit.deprecation import renamed

        renamed("graphkit.ElasticPool", "graphkit.ElasticReservation")
        return ElasticReservation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "SharedVMMAllocator",
    "SizeReport",
    "Sleeper",
    "StaticInputs",
    "TagReport",
    "Transaction",
    "graph_memory",
]
