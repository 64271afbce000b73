"""What every engine case reports about graphkit's own part of its capture, whichever the workload.

The engine-shaped loop (:mod:`graphkit_bench.engine_cases`) and the transformers model
(:mod:`graphkit_bench.hf`) measure their cases with these; :mod:`graphkit_bench.engines` summarises them.
"""

from __future__ import annotations

from typing import Any

import graphkit
from graphkit.memory.phases import PartTimes

#: graphkit's parts of capture time, as the bench reports them
PARTS = ("routing", "spaces", "maps", "verify")


#: the verifier's confirmation figures of a case: suspect words and what became of them, and its seconds
CONFIRMATION = ("suspect_words", "confirmed_words", "dismissed_words", "unconfirmed_words", "confirm_seconds")


def verify_figures(report: graphkit.PoolsReport | None) -> dict[str, Any]:
    """The isolation check's share of a case: graphs verified, nodes read and missed, seconds, and the
    confirmation of suspect words (:data:`CONFIRMATION`)."""
    if report is None:
        return dict.fromkeys(("verified_graphs", "inspected_nodes", "missed_nodes", "verify_seconds", *CONFIRMATION))
    return {"verified_graphs": report.verified_graphs, "inspected_nodes": report.inspected_nodes,
            "missed_nodes": report.missed_nodes, "verify_seconds": report.verify_seconds,
            **{name: getattr(report, name) for name in CONFIRMATION}}


def confirmation_line(label: str, figures: dict[str, Any]) -> str | None:
    """One line of what the verifier's confirmation did in a case (None where it found no suspect word)."""
    if not figures.get("suspect_words"):
        return None
    count = {name: figures.get(name) or 0 for name in CONFIRMATION}
    return (f"{label}: {count['suspect_words']:.0f} suspect word(s) confirmed by replays: "
            f"{count['confirmed_words']:.0f} confirmed, {count['dismissed_words']:.0f} dismissed, "
            f"{count['unconfirmed_words']:.0f} unconfirmed, {count['confirm_seconds'] * 1e3:.1f} ms")


def graphkit_share(parts: PartTimes, report: graphkit.PoolsReport | None, capture_seconds: float) -> dict[str, Any]:
    """graphkit's parts of the capture time: seconds of routing (its own, verification left out), setting up
    spaces, mapping chunks and verifying, and their sum as a share of the capture time."""
    seconds = dict(parts.seconds)
    verify = (report.verify_seconds or 0.0) if report is not None else 0.0
    if "routing" in seconds:  # graph_memory's router verifies inside its end of capture
        seconds["routing"] = max(seconds["routing"] - verify, 0.0)
    seconds["verify"] = verify
    total = sum(seconds.values())
    return {"graphkit_seconds": {part: seconds.get(part, 0.0) for part in PARTS}, "graphkit_total_seconds": total,
            "graphkit_share": total / capture_seconds if capture_seconds else None}


__all__ = ["CONFIRMATION", "PARTS", "confirmation_line", "graphkit_share", "verify_figures"]
