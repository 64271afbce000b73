"""graphkit.memory.ranges: arenas handed out in ranges, virtual spaces, and the table that alone writes them."""

from __future__ import annotations

import pytest

import graphkit
import hal
from graphkit.memory.backing import Chunk, Place
from graphkit.memory.ranges import Arena, SpaceTable
from tests.conftest import G
from tests.graphkit.memory.owners import reach_ins


def test_only_the_ranges_module_writes_a_tables_spaces_and_arenas() -> None:
    assert reach_ins("graphkit/memory/ranges.py", "SpaceTable") == []


def test_an_arena_hands_out_first_fit_and_coalesces_what_comes_back() -> None:
    arena = Arena(0x10000, 4 * G)
    a, b, c = arena.take(G), arena.take(2 * G), arena.take(G)
    assert (a, b, c) == (0x10000, 0x10000 + G, 0x10000 + 3 * G) and arena.take(1) is None
    arena.give(b, 2 * G)
    assert arena.take(3 * G) is None  # the hole is two granules
    arena.give(a, G)
    arena.give(c, G)
    assert arena.empty and arena.holes == [(0x10000, 4 * G)]  # neighbours merged both ways


def test_a_table_carves_spaces_from_one_arena_and_gives_an_empty_one_back(be: hal.Backend) -> None:
    table = SpaceTable(be, 8 * G)
    one, two = table.open(4 * G), table.open(4 * G)
    assert len(table.arenas) == 1 and be.live.ranges == 1 and two.base == one.base + 4 * G
    assert table.reserved_bytes == 8 * G and table.arena_reserved_bytes == 8 * G
    three = table.open(4 * G)  # no room left: a second arena
    assert len(table.arenas) == 2 and table.containing(three.base + 5) is three
    table.remove(three)
    assert len(table.arenas) == 1 and be.live.ranges == 1
    table.remove(one)
    table.remove(two)
    assert table.arenas == () and be.live.zero


def test_a_tables_spaces_and_arenas_are_read_only_views(be: hal.Backend) -> None:
    table = SpaceTable(be, 8 * G)
    space = table.open(4 * G)
    with pytest.raises(TypeError):
        table.spaces[99] = space  # type: ignore[index]
    with pytest.raises(AttributeError):
        table.spaces = {}  # type: ignore[misc]
    assert isinstance(table.arenas, tuple) and dict(table.spaces) == {space.id: space}
    table.release_all(set(), [])
    table.forget()
    assert table.spaces == {} and table.arenas == () and be.live.zero


def test_release_all_keeps_the_arenas_asked_for_and_collects_failures(be: hal.Backend) -> None:
    table = SpaceTable(be, 4 * G)
    kept, gone = table.open(4 * G), table.open(4 * G)
    errors: list[BaseException] = []
    be.faults.fail("release_vir_ptr", nth=1)
    table.release_all({id(kept.arena)}, errors)
    assert len(errors) == 1 and table.arenas == (kept.arena, gone.arena)  # the failed one stays recorded
    table.release_all({id(kept.arena)}, errors)
    assert table.arenas == (kept.arena,)
    table.release_all(set(), errors)
    assert table.arenas == () and be.live.zero


def test_frees_count_against_their_space_and_a_dying_space_waits_for_the_last(be: hal.Backend) -> None:
    table = SpaceTable(be, 8 * G)
    space = table.open(4 * G)
    ptr = space.allocate(100, 256, be, lambda end: None)
    table.free(0x1)  # in no space: only logged
    assert not table.mark_dying(space) and table.idle_dying() == []
    table.free(ptr)
    assert table.idle_dying() == [space]
    table.remove(space)
    assert be.live.zero


def test_a_space_grows_and_ungrows_only_at_its_end(be: hal.Backend) -> None:
    table = SpaceTable(be, 8 * G)
    space = table.open(4 * G)
    first, second = Place(space.base, Chunk(G)), Place(space.base + G, Chunk(G))
    space.grow(first)
    space.grow(second)
    assert not space.ungrow(first) and space.mapped == 2  # a later granule keeps this one below it
    assert space.ungrow(second) and space.ungrow(first) and space.mapped == 0
    table.remove(space)


def test_a_failed_reservation_leaves_the_table_as_it_was(be: hal.Backend) -> None:
    table = SpaceTable(be, 4 * G)
    table.open(4 * G)
    be.faults.fail("create_vir_ptr", nth=1)
    with pytest.raises(hal.DriverError, match="injected"):
        table.open(4 * G)
    assert len(table.spaces) == 1 and len(table.arenas) == 1 and be.live.ranges == 1
    table.release_all(set(), [])
    table.forget()
    assert be.live.zero


def test_opening_a_space_seals_no_other_and_switching_seals_the_current_one(be: hal.Backend) -> None:
    """Spaces opened side by side keep their room (several captures at once); only their owner seals them."""
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=8 * G)
    first, second = a.open_virtual_space(), a.open_virtual_space()
    assert a.current is None
    a.allocate(G, space_id=second)
    a.allocate(7 * G, space_id=first)  # opened before the other, it still grows to reserve_bytes
    assert not a.spaces[first].sealed and not a.spaces[second].sealed
    a.seal(second, "when its capture ended")
    with pytest.raises(hal.DeviceOutOfMemoryError, match=r"space \d+ was sealed at 64.0 KiB when its capture ended"):
        a.allocate(G, space_id=second)
    current = a.switch_to_new_virtual_space()
    a.allocate(G)
    a.switch_to_new_virtual_space()  # seals the current space, and that one only
    assert a.spaces[current].sealed and not a.spaces[first].sealed
    with pytest.raises(hal.DeviceOutOfMemoryError, match="when a newer space opened"):
        a.allocate(G, space_id=current)
    a.close()
    assert be.live.zero, be.live


def test_running_out_of_address_space_says_how_many_spaces_are_open(be: hal.Backend) -> None:
    a = graphkit.SharedVMMAllocator(be, reserve_bytes=4 * G, arena_bytes=8 * G)
    for _ in range(2):
        a.open_virtual_space()
    be.faults.fail("create_vir_ptr", error=hal.DeviceOutOfMemoryError("no room", backend="fake", call="create_vir_ptr"))
    with pytest.raises(hal.DeviceOutOfMemoryError, match=r"no address space left for a new space: 2 space\(s\) are "
                                                         r"open.*reserve_bytes=256.0 KiB.*release the keys"):
        a.open_virtual_space()
    assert a.num_virtual_spaces == 2 and a.num_arenas == 1
    a.close()
    assert be.live.zero, be.live
