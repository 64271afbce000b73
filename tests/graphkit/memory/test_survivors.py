"""graphkit.memory.survivors: granules under blocks that outlive their capture get chunks of their own."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import graphkit
import hal
from graphkit.memory.backing import Backing, Chunk
from graphkit.memory.chunks import SharedChunks
from graphkit.memory.ranges import SpaceTable, VirtualSpace
from graphkit.memory.survivors import Survivors, checked_blocks, granules_of
from tests.conftest import G
from tests.graphkit.memory.owners import reach_ins


def _two(be: hal.Backend) -> tuple[SharedChunks, SpaceTable, VirtualSpace, VirtualSpace]:
    """Chunks and two spaces that map the same two chunks."""
    chunks, table = SharedChunks(be), SpaceTable(be, 16 * G)
    a, b = table.open(4 * G), table.open(4 * G)
    chunks.map_up_to(a, 2, None)
    chunks.map_up_to(b, 2, None)
    return chunks, table, a, b


def _close(be: hal.Backend, chunks: SharedChunks, table: SpaceTable) -> None:
    for space in list(table.spaces.values()):
        chunks.unmap_space(space)
        table.remove(space)
    chunks.trim(0)
    assert be.live.zero, be.live


def test_only_the_survivors_module_writes_what_each_space_alone_maps() -> None:
    assert reach_ins("graphkit/memory/survivors.py", "Survivors") == []


def test_a_kept_granule_is_the_spaces_own_and_the_others_get_a_new_shared_chunk(be: hal.Backend) -> None:
    chunks, table, a, b = _two(be)
    shared = chunks.chunk(0)
    chunks.privatize(a, {0}, table.spaces.values())
    assert a.place(0).chunk is shared and chunks.chunk(0) is not shared and b.place(0).chunk is chunks.chunk(0)
    assert chunks.private_bytes == G and chunks.physical_bytes == 2 * G and be.live.chunks == 3
    assert chunks.on_shared(a, [(a.base, 16), (a.base + G, 16)]) == [(a.base + G, 16)]
    chunks.privatize(a, set(), table.spaces.values())  # freed: b maps a newer chunk, a maps it too
    assert a.place(0).chunk is chunks.chunk(0) is b.place(0).chunk and chunks.private_bytes == 0
    assert be.live.chunks == 2
    _close(be, chunks, table)


def test_a_failed_privatize_leaves_the_shared_chunk_where_it_was(be: hal.Backend) -> None:
    chunks, table, a, b = _two(be)
    shared = [chunks.chunk(0), chunks.chunk(1)]
    be.faults.fail("map", nth=2)  # granule 0 is given to a, then b's new chunk at granule 1 would not map
    with pytest.raises(hal.DriverError, match="injected"):
        chunks.privatize(a, {0, 1}, table.spaces.values())
    assert [chunks.chunk(0), chunks.chunk(1)] == shared
    assert [p.chunk for p in a.places] == shared == [p.chunk for p in b.places]
    assert chunks.private_bytes == 0 and be.live.chunks == 2 and be.live.mappings == 4
    _close(be, chunks, table)


def test_a_space_unmapped_releases_the_chunks_it_alone_mapped(be: hal.Backend) -> None:
    chunks, table, a, _ = _two(be)
    chunks.privatize(a, {0, 1}, table.spaces.values())
    assert chunks.private_bytes == 2 * G and be.live.chunks == 4
    chunks.unmap_space(a)
    table.remove(a)
    assert chunks.private_bytes == 0 and be.live.chunks == 2
    _close(be, chunks, table)


def test_what_a_space_alone_maps_is_shown_as_a_copy(be: hal.Backend) -> None:
    survivors = Survivors(be, Backing(be), SharedChunks(be))
    table = SpaceTable(be, 4 * G)
    space = table.open(4 * G)
    assert survivors.of(space) == {}
    survivors.of(space)[0] = Chunk(G)
    assert survivors.of(space) == {} and survivors.chunks() == []
    table.remove(space)


def test_granules_of_clips_blocks_to_what_the_space_maps(be: hal.Backend) -> None:
    chunks, table, a, _ = _two(be)
    assert granules_of(a, [(a.base + 10, G), (a.base + G, 2 ** 80), (0x1, 8), (a.base, 0)], G) == {0, 1}
    assert checked_blocks([(1, 2), [3, 0]], "fake", "call") == [(1, 2), (3, 0)]
    with pytest.raises(hal.InvalidArgumentError, match=r"blocks=.* must be \(address, nbytes\) pairs"):
        checked_blocks([(1, -1)], "fake", "call")
    _close(be, chunks, table)


def test_a_survivor_keeps_its_address_gets_bytes_no_other_space_maps_and_returns_to_the_shared_set() -> None:
    """keep_private: the granule under a block that outlives its capture is backed by a chunk of its own (its
    bytes copied), so another space's writes no longer reach it; freed, it maps the shared chunk again."""
    with hal.get_backend("fake", granularity=1 << 16) as be:
        g = be.granularity
        alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * g)
        a, b = alloc.open_virtual_space(), alloc.open_virtual_space()
        pa, pb = alloc.allocate(2 * g, space_id=a), alloc.allocate(2 * g, space_id=b)
        ta, tb = be.tensor_at(pa, 2 * g), be.tensor_at(pb, 2 * g)
        ta.fill_(7)
        assert int(tb[0]) == 7  # one set of chunks under both spaces
        alloc.keep_private(a, [(pa + 16, 64)])  # a block in a's first granule outlives its capture
        assert (alloc.shared_bytes, alloc.survivor_bytes, alloc.physical_bytes) == (2 * g, g, 3 * g)
        assert be.tensor_at(pa, 1).data_ptr() == pa  # same address
        tb.fill_(1)  # another space's replay writes the shared chunks
        assert bool((ta[:g] == 7).all()) and bool((ta[g:] == 1).all())  # its own bytes kept (copied), the rest shared
        alloc.keep_private(a, [])  # the block was freed
        assert alloc.survivor_bytes == 0 and alloc.physical_bytes == 2 * g
        assert bool((ta == 1).all())  # the shared chunk is mapped there again
        alloc.keep_private(a, [(pa, 2 * g)])
        alloc.release_virtual_space(a)  # a space released with survivors releases their chunks too
        assert alloc.survivor_bytes == 0
        del ta, tb
        alloc.close()
        assert be.live.chunks == 0


def test_a_survivor_in_a_granule_no_other_space_reaches_costs_nothing_until_one_does() -> None:
    """The space keeps the chunk under its survivor; the shared chunk at that offset is made only when another
    space reaches it: the largest capture's kept output costs no second copy (as in the engine's own pool)."""
    with hal.get_backend("fake", granularity=1 << 16) as be:
        g = be.granularity
        alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * g)
        big, small = alloc.open_virtual_space(), alloc.open_virtual_space()
        pbig = alloc.allocate(3 * g, space_id=big)
        alloc.allocate(g, space_id=small)
        kept = be.tensor_at(pbig + 2 * g, g)
        kept.fill_(5)
        alloc.keep_private(big, [(pbig + 2 * g, 64)])  # the big capture's output, in its last granule
        assert (alloc.physical_bytes, alloc.survivor_bytes) == (3 * g, g)  # nothing made, nothing copied
        psmall = alloc.allocate(2 * g, space_id=small)  # the small space now reaches offset 2: a new shared chunk
        assert alloc.physical_bytes == 4 * g and alloc.footprint_bytes == 4 * g
        be.tensor_at(psmall, 2 * g).fill_(9)
        assert bool((kept == 5).all())  # its key's alone
        alloc.keep_private(big, [])  # freed: the small space maps the newer chunk, the big one maps it too
        assert (alloc.physical_bytes, alloc.survivor_bytes) == (3 * g, 0) and bool((kept == 9).all())
        del kept
        alloc.close()
        assert be.live.chunks == 0


@given(st.lists(st.tuples(st.sampled_from(["grow", "keep", "free", "write", "sleep", "release"]),
                          st.integers(0, 2), st.integers(1, 4)), max_size=25))
@settings(max_examples=40, deadline=None)
def test_survivors_keep_their_bytes_whatever_the_other_spaces_do(steps: list[tuple[str, int, int]]) -> None:
    """Random growth, survivors kept and freed, writes through every space, sleeps and releases over three spaces:
    a granule a space keeps holds what that space last wrote there; every held chunk is accounted for; nothing
    leaks at close."""
    with hal.get_backend("fake", granularity=1 << 16) as be:
        g = be.granularity
        alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * g)
        spaces = [alloc.open_virtual_space() for _ in range(3)]
        bases = {sid: alloc.allocate(g, space_id=sid) for sid in spaces}
        kept: dict[int, dict[int, int]] = {sid: {} for sid in spaces}  # space -> granule -> stamp it holds
        stamp = 0
        for op, which, n in steps:
            sid = spaces[which]
            if sid not in alloc.spaces:
                continue
            space = alloc.spaces[sid]
            if op == "grow" and space.offset + n * g <= 8 * g:
                alloc.allocate(n * g, space_id=sid)
            elif op == "keep":
                granules = sorted({*kept[sid], (n - 1) % space.mapped})
                for i in granules:
                    stamp += 1
                    be.tensor_at(bases[sid] + i * g, g).fill_(stamp % 251)
                    kept[sid][i] = stamp % 251
                alloc.keep_private(sid, [(bases[sid] + i * g, g) for i in granules])
            elif op == "free" and kept[sid]:
                kept[sid].pop(min(kept[sid]))
                alloc.keep_private(sid, [(bases[sid] + i * g, g) for i in kept[sid]])
            elif op == "write":  # a replay of this space writes everything it maps
                be.tensor_at(bases[sid], space.mapped * g).fill_(255)
                for i in kept[sid]:
                    be.tensor_at(bases[sid] + i * g, g).fill_(kept[sid][i])
            elif op == "sleep":
                before = {s: {i: int(be.tensor_at(bases[s] + i * g, 1)[0]) for i in kept[s]} for s in kept
                          if s in alloc.spaces}
                alloc.release_physical()
                alloc.restore_physical()
                for s, granules in before.items():  # graph memory keeps no backup: rewrite what is kept
                    for i, value in granules.items():
                        be.tensor_at(bases[s] + i * g, g).fill_(value)
            elif op == "release":
                alloc.release_virtual_space(sid)
                kept[sid] = {}
                continue
            for s, granules in kept.items():  # a kept granule holds its space's last write, whatever others did
                for i, value in granules.items():
                    assert int(be.tensor_at(bases[s] + i * g, g).min()) == value == int(
                        be.tensor_at(bases[s] + i * g, g).max()), (s, i, value)
            held = {id(p.chunk) for sp in alloc.spaces.values() for p in sp.places}
            assert alloc.survivor_bytes == sum(len(k) for k in kept.values()) * g
            assert alloc.physical_bytes >= len(held) * g - alloc.pending_release * g
            assert be.live.chunks == alloc.physical_bytes // g + alloc.pending_release
        alloc.close()
        assert be.live.chunks == 0 and be.live.mappings == 0


_HUGE_BLOCK = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # enumerating 2**64 granules dies here, not the machine
import hal, graphkit
be = hal.get_backend("fake", granularity=1 << 16)
alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 << 16)
sid = alloc.open_virtual_space()
ptr = alloc.allocate(100, space_id=sid)
alloc.keep_private(sid, [(ptr, 2 ** 80)])  # clipped to the granule the space maps
assert alloc.survivor_bytes == 1 << 16
print(alloc.on_shared_chunks(sid, [(ptr, 2 ** 80)]))
alloc.close()
"""


def test_keep_private_bounds_a_huge_block_by_arithmetic_and_refuses_bad_blocks(be: hal.Backend) -> None:
    """A block of 2**80 bytes costs what the space maps (it used to enumerate every granule it named: hang,
    unbounded memory); a negative size or a block that is not an (address, nbytes) pair is a hal error."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _HUGE_BLOCK], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]
    alloc = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    sid = alloc.open_virtual_space()
    ptr = alloc.allocate(100, space_id=sid)
    for blocks in ([(ptr, -5)], [(ptr,)], [(ptr, 1.5)], [(ptr, True)], None, "blocks", 5, [ptr]):
        with pytest.raises(hal.InvalidArgumentError, match=r"blocks=.* must be \(address, nbytes\) pairs"):
            alloc.keep_private(sid, blocks)  # type: ignore[arg-type]
    assert alloc.survivor_bytes == 0
    alloc.close()


def test_pinned_granules_keep_their_chunks_and_another_spaces_survivor_gets_a_copy(be: hal.Backend) -> None:
    chunks, table, a, b = _two(be)
    shared = chunks.chunk(0)
    chunks.pin(b, range(0, 1))  # another process maps b's granule 0 (the shared chunk)
    be.tensor_at(b.base, 8).copy_(be.tensor_at(b.base, 8).new_tensor(list(b"b's data")))
    chunks.privatize(b, {0}, table.spaces.values())  # b's own survivor: held off, its granule stays shared
    assert b.place(0).chunk is shared is chunks.chunk(0)
    chunks.privatize(a, {0}, table.spaces.values())  # a's survivor: a copy of its own, b keeps the shared chunk
    assert b.place(0).chunk is shared is chunks.chunk(0) and a.place(0).chunk is not shared
    assert bytes(be.tensor_at(a.base, 8).tolist()) == b"b's data"  # the bytes a showed, copied
    be.tensor_at(a.base, 1).fill_(0)
    assert bytes(be.tensor_at(b.base, 8).tolist()) == b"b's data"
    chunks.unpin(b.id, range(0, 1))
    chunks.privatize(b, {0}, table.spaces.values())  # unpinned: b takes the shared chunk as its own again
    assert b.place(0).chunk is shared and chunks.chunk(0) is not shared
    chunks.privatize(a, set(), table.spaces.values())
    chunks.privatize(b, set(), table.spaces.values())
    _close(be, chunks, table)
