"""Map calls of the vmm strategy on fake: lazy per-space mapping against mapping every chunk into every space.

``python -m graphkit_bench.mapcalls``: a 4-layer decoder, 11 sizes, 64 KiB granules; counts, not times.
"""

from __future__ import annotations

import sys

import torch

import graphkit
import hal
from graphkit.graphs.strategies import VmmPools
from graphkit_bench.cli import CliParser
from graphkit_bench.model import Decoder, DecoderConfig


def main(argv: list[str] | None = None) -> int:
    """Print, per capture order, the map calls made against those mapping every chunk into every space makes.

    Takes no arguments but ``--help``: any other exits 2 with one line, as the other benches do.
    """
    parser = CliParser(prog="python -m graphkit_bench.mapcalls", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [1, 2, 4, *range(8, 65, 8)]
    cfg = DecoderConfig(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=768, vocab=4096, context=32,
                        dtype="float32")
    for order in ("descending", "ascending"):
        be = hal.get_backend("fake", requires=("graphs", "custom_pool"), granularity=64 << 10)
        model = Decoder(cfg, max(sizes), be.torch_device())
        runner = graphkit.GraphRunner(model.step, sizes, backend=be, kind="vmm", progress=False)
        runner.capture(model.example_inputs(max(sizes)), order=order)
        assert isinstance(runner.strategy, VmmPools)
        alloc = runner.strategy.allocator
        spaces = alloc.spaces.values()
        lazy = alloc.map_calls
        chunks = len(alloc.chunks)
        # the eager policy maps every chunk that exists when a space opens, and every new chunk into every live space
        eager = existing = 0
        for live, s in enumerate(sorted(spaces, key=lambda s: s.id), start=1):
            eager += existing            # switch: map all existing chunks into the new space
            if s.mapped > existing:      # extend: new chunks mapped into every live space
                eager += (s.mapped - existing) * live
                existing = s.mapped
        print(f"{order}: {len(sizes)} spaces, {chunks} chunks of 64 KiB, map calls lazy {lazy} "
              f"vs every-chunk-everywhere {eager} ({eager / lazy:.1f}x), arenas {alloc.num_arenas}, "
              f"reserved {alloc.reserved_bytes >> 20} MiB of spaces")
        runner.close()
        be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
