"""What capturing cost: per size and in total."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphkit.deprecation import renamed
from hal.types import fmt_bytes


@dataclass(frozen=True)
class SizeReport:
    size: int
    capture_seconds: float
    memory_delta: int
    """Device used-memory growth while this size was captured (bytes)."""
    chunk_bytes: int | None = None
    """vmm only: physical chunk bytes after this capture."""


@dataclass(frozen=True)
class RunnerReport:
    backend: str
    kind: str
    """The pool kind: ``vmm``, ``shared``, ``private`` or ``none``."""
    mode: str
    sizes: list[SizeReport] = field(default_factory=list)
    graph_bytes: int = 0
    """Device memory used beyond what was used before the first capture (bytes)."""
    pool_figures: dict[str, int] = field(default_factory=dict)

    @property
    def pool(self) -> str:
        """Deprecated spelling of :attr:`kind`."""
        renamed("RunnerReport.pool", "kind")
        return self.kind

    @property
    def graph_memory(self) -> int:
        """Deprecated spelling of :attr:`graph_bytes`."""
        renamed("RunnerReport.graph_memory", "graph_bytes")
        return self.graph_bytes

    @property
    def capture_seconds(self) -> float:
        return sum(s.capture_seconds for s in self.sizes)

    def __str__(self) -> str:
        lines = [(f"GraphRunner on {self.backend}: kind={self.kind} mode={self.mode}, "
                  f"{len(self.sizes)} size(s) captured in {self.capture_seconds:.3f} s, "
                  f"graph memory {fmt_bytes(self.graph_bytes)}")]
        for key, value in self.pool_figures.items():
            lines.append(f"  {key}: {fmt_bytes(value) if key.endswith('bytes') else value}")
        lines.append(f"  {'batch':>6} {'capture s':>10} {'memory +':>11} {'chunks':>11}")
        for s in self.sizes:
            chunks = fmt_bytes(s.chunk_bytes) if s.chunk_bytes is not None else "-"
            lines.append(f"  {s.size:>6} {s.capture_seconds:>10.4f} {fmt_bytes(s.memory_delta):>11} {chunks:>11}")
        return "\n".join(lines)
