"""The value of ``GRAPHKIT_GRAPH_MEMORY``, its one home: the :class:`Options` it asks for, :func:`parse` that reads
it (the switch, :mod:`graphkit.switch`) and :func:`written` that writes it (a :func:`graphkit.graph_memory` block,
for the processes it starts: :func:`graphkit.graphs.scope.served_children`)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import hal
from _graphkit_startup import ENV, OFF, ON
from graphkit.graphs.executables import DEFAULT, Budget, checked_budget
from graphkit.graphs.strategies import POOL_KINDS


@dataclass(frozen=True)
class Options:
    """What the switch does: the pools' ``kind``, ``verify`` and ``hygiene``, and after how many quiet seconds
    a device's report line is logged (0: at exit only)."""

    kind: str = "vmm"
    verify: bool = False
    hygiene: bool = False
    outputs: str = "kept"
    report: float = 2.0
    #: the pools' executables budget (``"lazy"``, executable graphs kept per topology, or None: see GraphPools)
    executables: Budget = DEFAULT
    #: a vLLM-style custom all-reduce whose graph-buffer registration graphkit serves, as soon as its binding is
    #: imported (``"flashinfer"``, or the binding's module: ``"vllm._custom_ops"``); the pools' chunks are then
    #: shareable (:mod:`graphkit.graphs.allreduce`). None: off
    allreduce: str | None = None

    def __post_init__(self) -> None:
        bad = []
        try:
            checked_budget(self.executables, "graphkit.switch.Options")
        except hal.InvalidArgumentError as exc:
            bad.append(exc.message)
        if self.kind not in POOL_KINDS:
            bad.append(f"kind={self.kind!r} must be one of {', '.join(POOL_KINDS)}")
        for name in ("verify", "hygiene"):
            if not isinstance(getattr(self, name), bool):
                bad.append(f"{name}={getattr(self, name)!r} must be a bool")
        if self.allreduce is not None and not _module_path(self.allreduce):
            bad.append(f"allreduce={self.allreduce!r} must be 'flashinfer' or a module path (vllm._custom_ops)")
        if not _report_seconds(self.report):
            bad.append(f"report={self.report!r} must be seconds >= 0 that a timer can wait (0: at exit only)")
        if bad:
            raise hal.InvalidArgumentError("; ".join(bad), call="graphkit.switch.Options")


#: the longest quiet time before a report line: what threading.Timer can wait (a longer one kills its thread)
_MAX_REPORT = float(threading.TIMEOUT_MAX)


def _module_path(value: Any) -> bool:
    return isinstance(value, str) and all(part.isidentifier() for part in value.split("."))


def _report_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0 <= value <= _MAX_REPORT)


def parse(value: str | None) -> Options | None:
    """The options ``value`` (the variable's value) asks for; None when it says off.

    :raises hal.InvalidArgumentError: a value that is no str (nor None), or asks for what the switch cannot do.
    """
    if value is not None and not isinstance(value, str):
        raise hal.InvalidArgumentError(f"value={value!r} must be the variable's text (a str) or None; give 1, or "
                                       f"a comma-separated list of kind={'|'.join(POOL_KINDS)}, verify=0|1, "
                                       "hygiene=0|1, report=SECONDS", call=ENV)
    text = (value or "").strip().lower()
    if text in OFF:
        return None
    if text in ON:
        return Options()
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in ON:  # "yes,verify=1": the word that turns it on, beside options
            continue
        key, _, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        try:
            if key in fields:
                raise ValueError(key)
            fields[key] = _option(key, raw)
        except (KeyError, ValueError) as exc:
            what = ("is given twice" if key in fields else "is not an option" if isinstance(exc, KeyError)
                    else "has a value the option does not take")
            raise hal.InvalidArgumentError(
                f"{item!r} {what} (the value is {value!r}); give 1, or a comma-separated list of "
                f"kind={'|'.join(POOL_KINDS)}, outputs=kept|replay, verify=0|1, hygiene=0|1, "
                "report=SECONDS (0: at exit only), executables=lazy|N|off (N >= 1 per topology), "
                "allreduce=flashinfer|MODULE|off",
                call=ENV) from None
    return Options(**fields)


def _option(key: str, raw: str) -> Any:
    if key == "kind":
        if raw not in POOL_KINDS:
            raise ValueError(raw)
        return raw
    if key == "outputs":
        if raw not in ("kept", "replay"):
            raise ValueError(raw)
        return raw
    if key in ("verify", "hygiene"):
        if raw not in ON + OFF[1:]:
            raise ValueError(raw)
        return raw in ON
    if key == "report":
        seconds = float(raw)
        if not _report_seconds(seconds):
            raise ValueError(raw)
        return seconds
    if key == "allreduce":
        if raw in ("off", "none", "0"):
            return None
        if not _module_path(raw):
            raise ValueError(raw)
        return raw
    if key == "executables":
        if raw in ("off", "none"):
            return None
        if raw == "lazy":
            return raw
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(raw)
        return int(raw)
    raise KeyError(key)


def written(kind: str, outputs: str, verify: bool, hygiene: bool, executables: Budget) -> str:
    """The value that asks for pools with these options (what :func:`parse` reads back; the report's quiet time
    is left to the default)."""
    budget = executables if executables is not None else "off"
    return f"kind={kind},outputs={outputs},verify={int(verify)},hygiene={int(hygiene)},executables={budget}"


__all__ = ["Options", "parse", "written"]
