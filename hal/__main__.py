"""``python -m hal``: backends, why unavailable ones are unavailable, devices, granularity, memory."""

from __future__ import annotations

import argparse
import sys

import hal
from hal.types import fmt_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hal", description=__doc__)
    parser.add_argument("--refresh", action="store_true", help="discover and probe again")
    parser.parse_args(argv)
    infos = hal.list_backends()
    width = max(len(i.name) for i in infos)
    print("hal backends (in the order automatic selection tries them):")
    for info in infos:
        state = "available" if info.available else "unavailable"
        print(f"  {info.name:<{width}}  {state:<11}  [{info.origin}]")
        if not info.available:
            print(f"  {'':<{width}}  reason: {info.reason}")
            continue
        try:
            with hal.get_backend(info.name) as be:
                mem = be.mem_info()
                print(f"  {'':<{width}}  devices: {be.device_count()}  granularity: "
                      f"{fmt_bytes(be.granularity)} (recommended {fmt_bytes(be.recommended_granularity)})  "
                      f"memory: {fmt_bytes(mem.free)} free of {fmt_bytes(mem.total)}  "
                      f"capabilities: {', '.join(sorted(be.capabilities)) or '-'}")
        except hal.HalError as exc:
            print(f"  {'':<{width}}  error while opening: {exc}")
    try:
        print(f"selected by default: {hal.registry.select_backend_name()}")
    except hal.HalError as exc:
        print(f"no backend can be selected: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
