"""graphkit: capture device graphs for many shapes at the memory cost of the largest, on any hal backend."""

from graphkit.allocator import SharedVMMAllocator
from graphkit.buffers import StaticInputs
from graphkit.capture import CaptureHygieneError
from graphkit.report import RunnerReport, SizeReport
from graphkit.runner import GraphRunner

__all__ = ["CaptureHygieneError", "GraphRunner", "RunnerReport", "SharedVMMAllocator", "SizeReport",
           "StaticInputs"]
