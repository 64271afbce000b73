"""examples/turns: two engine processes whose graphs map the same chunks take turns through a flock, decode
exactly as eagerly, pay the graph memory once, and go on when the holder of the turn is killed."""

from __future__ import annotations

import fcntl
import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "examples" / "turns"))  # spawned processes import the example by name too
import turns


@pytest.fixture(scope="module")
def shared():
    return turns.run_pair("shared", "fake", timeout=400)


@pytest.fixture(scope="module")
def independent():
    return turns.run_pair("independent", "fake", timeout=400)


def test_the_turn_excludes_another_opener_and_is_free_again_once_given_back(tmp_path) -> None:
    first, second = turns.Turn(tmp_path / "turn"), turns.Turn(tmp_path / "turn")
    try:
        first.acquire()
        with pytest.raises(BlockingIOError):
            fcntl.flock(second.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.release()
        assert second.acquire() < 1.0
        second.release()
        assert first.cost(rounds=50) > 0
    finally:
        first.close()
        second.close()


def test_the_turn_is_given_back_only_after_the_device_ran_the_holders_work(tmp_path) -> None:
    """A GPU runs a step after the holder queued it: the turn must outlast that work, or the other process's
    replay overwrites the shared bytes under it (seen on an H100: the exporter's logits off by 5.9)."""
    other = turns.Turn(tmp_path / "turn")
    held_while_waiting: list[bool] = []

    class Device:
        def synchronize(self) -> None:
            try:
                fcntl.flock(other.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held_while_waiting.append(True)
            else:
                fcntl.flock(other.fd, fcntl.LOCK_UN)
                held_while_waiting.append(False)

    turn = turns.Turn(tmp_path / "turn", Device())  # type: ignore[arg-type]
    try:
        with turn():
            pass
        assert held_while_waiting == [True]
        assert other.acquire() < 1.0  # and then it is free
        other.release()
    finally:
        turn.close()
        other.close()


def test_both_engines_decode_exactly_as_eagerly_over_one_set_of_chunks(shared) -> None:
    assert shared["exitcodes"] == {"exporter": 0, "importer": 0}, shared
    exporter, importer = shared["exporter"], shared["importer"]
    for run in (exporter, importer):
        assert "error" not in run, run
        assert run["tokens_equal_eager"] and run["max_abs_error"] <= 1e-5
    # the importer created no graph memory: it maps the exporter's chunks, the very same memfds
    assert importer["created_bytes"] == 0 and importer["imported_bytes"] == exporter["graph_bytes"] > 0
    assert exporter["created_bytes"] == exporter["graph_bytes"]
    # the chunks it maps are the exporter's memfds (its own are those of its elastic KV cache)
    assert importer["imported_inodes"] and set(importer["imported_inodes"]) <= set(exporter["chunk_inodes"])


def test_the_kv_caches_are_elastic_and_given_back_after_decoding(shared) -> None:
    for role in turns.ROLES:
        run = shared[role]
        assert run["kv"] == "elastic"
        assert run["kv_idle_bytes"] == run["kv_after_bytes"] <= run["kv_peak_bytes"], run


def test_an_elastic_kv_cache_maps_the_batch_for_the_decoding_only() -> None:
    import hal

    with hal.get_backend("fake", granularity=4096) as be:
        engine = turns.engine_decode.Engine(be, turns.MODELS["importer"], max_batch=4, max_model_len=64,
                                            kv="elastic", kv_max_blocks=17)
        try:
            idle, peaks = turns.kv_bytes(engine), []
            with turns.kv_for(engine, 4, 64, peaks):
                assert engine.num_blocks >= 1 + 4 * 4
                engine.block_tables_for(4, 64)  # the batch fits
            assert peaks and peaks[0] > idle
            assert turns.kv_bytes(engine) == idle and engine.num_blocks < 1 + 4 * 4
        finally:
            engine.close()


def test_two_engines_taking_turns_pay_the_larger_graph_memory_not_both(shared, independent) -> None:
    assert independent["exitcodes"] == {"exporter": 0, "importer": 0}, independent
    apart = {role: independent[role]["created_bytes"] for role in turns.ROLES}
    assert all(apart.values()) and all(independent[r]["tokens_equal_eager"] for r in turns.ROLES)
    together = sum(shared[role]["created_bytes"] for role in turns.ROLES)
    assert together == max(apart.values()) < sum(apart.values())
    lines = turns.summary(shared, independent)
    assert "shared / independent graph memory" in lines[-2] and lines[-1].startswith("a turn (flock")


def test_a_holder_killed_while_it_holds_the_turn_does_not_block_the_other() -> None:
    """The importer takes the turn, replays into the shared bytes and is killed (SIGKILL) holding it: the
    kernel releases its flock, and the exporter, which waited meanwhile, decodes exactly."""
    run = turns.run_pair("shared", "fake", crash=True, hold_s=1.0, timeout=400)
    assert "killed_holder" in run and run["exitcodes"]["importer"] == -9, run
    exporter = run["exporter"]
    assert "error" not in exporter, exporter
    assert exporter["longest_wait_s"] >= 0.9  # it really waited for the dead holder's turn
    assert exporter["tokens_equal_eager"] and exporter["max_abs_error"] <= 1e-5
    assert run["exitcodes"]["exporter"] == 0


@pytest.mark.cuda
@pytest.mark.slow  # two runs of two engine processes each
def test_on_cuda_two_engines_share_one_set_of_chunks_and_decode_exactly() -> None:
    """The same pair on a GPU (chunks exported as POSIX file descriptors): the importer creates no chunk of its
    own, maps all of the exporter's, both decode as eagerly, and together they pay less than apart."""
    shared = turns.run_pair("shared", "cuda", timeout=400, config="tiny")
    independent = turns.run_pair("independent", "cuda", timeout=400, config="tiny")
    for run in (shared, independent):
        assert run["exitcodes"] == {"exporter": 0, "importer": 0}, run
        assert all(run[r]["tokens_equal_eager"] for r in turns.ROLES), run
    exporter, importer = shared["exporter"], shared["importer"]
    assert importer["graph_bytes"] == importer["imported_bytes"] == exporter["graph_bytes"] > 0
    # on a GPU the device's used memory also moves by the driver's memory per graph: the importer's growth
    # is that alone, below what its own chunks cost when it captures apart
    assert importer["created_bytes"] < independent["importer"]["created_bytes"]
    together = sum(shared[r]["created_bytes"] for r in turns.ROLES)
    assert together < sum(independent[r]["created_bytes"] for r in turns.ROLES)
