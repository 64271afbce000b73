"""``python -m hal``: backends, why unavailable ones are unavailable, devices, granularity, memory."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NoReturn

import hal
from hal.types import fmt_bytes


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def env_backend_error() -> str | None:
    """Why ``$HAL_BACKEND`` names no usable backend, in one line; ``None`` when it is unset or usable."""
    name = os.environ.get("HAL_BACKEND")
    if not name:
        return None
    infos = {info.name: info for info in hal.list_backends()}
    if name not in infos:
        return f"HAL_BACKEND: unknown backend {name!r} (known: {', '.join(infos)})"
    if not infos[name].available:
        return f"HAL_BACKEND: backend {name!r} is not available: {infos[name].reason}"
    return None


def capability_report(be: hal.Backend) -> list[str]:
    """The torch extension a backend found and why each capability is on or off, where the backend says."""
    report = getattr(be.plugin, "capability_report", None)
    if report is None:
        return []
    extension, reasons = report()
    return [f"torch extension: {extension or 'none (VMM hooks only)'}"] + [
        f"  {capability}: {'on' if be.supports(capability) else 'off'} ({why})"
        for capability, why in sorted(reasons.items())]


def _details(info: hal.BackendInfo) -> tuple[list[str], str]:
    """The lines describing an available backend, or why it cannot be opened after all."""
    lines = []
    try:
        with hal.get_backend(info.name) as be:
            mem = be.mem_info()
            lines.append(f"devices: {be.device_count()}  granularity: "
                         f"{fmt_bytes(be.granularity)} (recommended {fmt_bytes(be.recommended_granularity)})  "
                         f"memory: {fmt_bytes(mem.free)} free of {fmt_bytes(mem.total)}  "
                         f"capabilities: {', '.join(sorted(be.capabilities)) or '-'}")
            lines += [f"warning: {why}" for why in hal.registry.dropped_capabilities(be)]
            lines += capability_report(be)
    except hal.BackendUnavailableError as exc:  # its constructor failed: unavailable, with the reason
        return [], exc.message.removeprefix("backend is not available: ")
    except hal.HalError as exc:
        lines.append(f"error while opening: {exc}")
    return lines, ""


def main(argv: list[str] | None = None) -> int:
    """List the backends; exit code 2 and one line on stderr when ``$HAL_BACKEND`` names no usable one."""
    parser = _Parser(prog="python -m hal", description=__doc__)
    parser.add_argument("--refresh", action="store_true", help="discover and probe again")
    args = parser.parse_args(argv)
    infos = hal.list_backends(refresh=args.refresh)
    why = env_backend_error()
    if why:
        print(f"{parser.prog}: error: {' '.join(why.split())}", file=sys.stderr)
        return 2
    width = max(len(i.name) for i in infos)
    print("hal backends (in the order automatic selection tries them):")
    for info in infos:
        lines, reason = _details(info) if info.available else ([], info.reason)
        state = "unavailable" if reason else "available"
        print(f"  {info.name:<{width}}  {state:<11}  [{info.origin}]")
        for line in [f"reason: {reason}"] if reason else lines:
            print(f"  {'':<{width}}  {line}")
    try:
        be = hal.get_backend()  # what selection really gives: a backend that fails to start gives way
    except hal.HalError as exc:
        print(f"no backend can be selected: {exc}")
    else:
        print(f"selected by default: {be.name}")
        with contextlib.suppress(hal.HalError):  # a failing close() is in its listing above already
            be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
