"""Capture a bf16 decoder-like step for several batch sizes into vmm pools and replay them.

Each size is captured into a fresh pool over a fresh virtual space of one
SharedVMMAllocator (all spaces share the same physical chunks), then the
graphs are replayed in random order and every output is compared with the
eager result. With ``--no-warmup`` the step never runs on the capture stream
before the first capture (state it creates then is born inside a capture).

Prints progress lines and one final ``RESULT {json}`` line. Exit status: 0
when every replay matched eager, 3 when one did not, 4 when
``--strict-hygiene`` and memory other than the outputs outlived a capture.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

import torch
import torch.nn.functional as F

import hal
from graphkit import SharedVMMAllocator


def log(msg: str) -> None:
    print(msg, flush=True)


def make_layers(n: int, hidden: int, mlp: int, device: torch.device, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def w(i: int, o: int) -> torch.Tensor:
        return (torch.randn(i, o, generator=gen) / i ** 0.5).to(device, torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, torch.bfloat16)

    return [dict(ln1=norm(), qkv=w(hidden, 3 * hidden), o=w(hidden, hidden), ln2=norm(),
                 gate_up=w(hidden, 2 * mlp), down=w(mlp, hidden)) for _ in range(n)]


def decoder_step(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Pre-norm blocks: token-local gated mixing in place of attention, then a SiLU-gated MLP."""
    h = x
    hidden = x.shape[-1]
    for p in layers:
        a = F.layer_norm(h, (hidden,), p["ln1"])
        q, k, v = (a @ p["qkv"]).chunk(3, dim=-1)
        h = h + (torch.sigmoid(q * k) * v) @ p["o"]
        a = F.layer_norm(h, (hidden,), p["ln2"])
        gate, up = (a @ p["gate_up"]).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ p["down"]
    return F.layer_norm(h, (hidden,))


def overlaps(block: tuple[int, int], t: torch.Tensor) -> bool:
    s = t.untyped_storage()
    return block[0] < s.data_ptr() + s.nbytes() and s.data_ptr() < block[0] + block[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up on the capture stream")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--mlp", type=int, default=5632)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--order", choices=("largest-first", "ascending", "random"), default="largest-first")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strict-hygiene", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    sizes = [int(s) for s in args.sizes.split(",")]
    be = hal.get_backend("cuda", device=args.device)
    dev = be.torch_device()
    rng = random.Random(args.seed)
    layers = make_layers(args.layers, args.hidden, args.mlp, dev, args.seed)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    xs = {n: torch.randn(n, args.hidden, generator=gen).to(dev, torch.bfloat16) for n in sizes}
    with torch.no_grad():
        refs = {n: decoder_step(xs[n], layers).float() for n in sizes}  # eager, on the default stream
    be.synchronize(None)

    stream = be.create_stream()
    if not args.no_warmup:
        with torch.no_grad(), be.use_stream(stream):
            for n in sizes:
                decoder_step(xs[n], layers)
        be.synchronize(stream)
        log("warm-up on the capture stream: done")
    else:
        log("warm-up on the capture stream: SKIPPED")

    alloc = SharedVMMAllocator(be, reserve_bytes=8 << 30)
    order = sorted(sizes, reverse=True) if args.order == "largest-first" else sorted(sizes)
    if args.order == "random":
        rng.shuffle(order)
    caps: dict[int, tuple] = {}
    leftovers: dict[int, list[tuple[int, int]]] = {}
    t0 = time.perf_counter()
    for n in order:
        space = alloc.switch_to_new_virtual_space()
        pool = be.create_pool(*alloc.pool_callbacks(space))
        graph = be.create_graph()
        with torch.no_grad(), be.capture(graph, pool, stream):
            out = decoder_step(xs[n], layers)
        be.synchronize(stream)
        left = [b for b in be.pool_active_blocks(pool) if not overlaps(b, out)]
        leftovers[n] = left
        caps[n] = (graph, pool, space, out)
        log(f"captured size {n}: space {space}, {len(left)} leftover block(s) "
            f"{[(hex(p), s) for p, s in left]}")
    capture_s = time.perf_counter() - t0
    physical_mib = alloc.physical_bytes >> 20
    log(f"physical {physical_mib} MiB for {len(sizes)} graphs, capture {capture_s:.2f} s")

    errors: dict[int, float] = {}
    replay_order = sizes * args.rounds
    rng.shuffle(replay_order)
    for i, n in enumerate(replay_order):
        graph, _, _, out = caps[n]
        log(f"replay {i}: size {n} ...")
        be.replay(graph)
        be.synchronize(None)
        err = float((out.float() - refs[n]).norm() / refs[n].norm())
        errors[n] = max(errors.get(n, 0.0), err)
        log(f"replay {i}: size {n} relative error {err:.2e}")

    for n, (graph, pool, space, out) in list(caps.items()):
        caps[n] = ()
        del out
        be.release_graph(graph)
        be.release_pool(pool)
        alloc.release_virtual_space(space)
    alloc.close()
    be.close()

    bad = {n: e for n, e in errors.items() if not e < 2e-2}
    dirty = {n: len(b) for n, b in leftovers.items() if b}
    result = {"warmup": not args.no_warmup, "sizes": sizes, "order": order, "max_rel_error": max(errors.values()),
              "mismatched": bad, "leftover_blocks": dirty,
              "leftover_bytes": {n: sum(s for _, s in b) for n, b in leftovers.items() if b},
              "physical_mib": physical_mib, "capture_s": round(capture_s, 3)}
    log("RESULT " + json.dumps(result))
    if bad:
        return 3
    if dirty and args.strict_hygiene:
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
