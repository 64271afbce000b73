"""The sleep bench end to end on fake, at small sizes: every implementation, with and without backup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import graphkit
import hal
from graphkit_bench import sleep

MIB = 1 << 20


def test_the_sleep_bench_prints_every_implementation_and_leaves_out_what_does_not_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    sync, pause = hal.Backend.synchronize, graphkit.MemorySaver.pause

    def synchronize(self: hal.Backend) -> None:
        events.append("sync")
        sync(self)

    def paused(self: graphkit.MemorySaver, *tags: str) -> int:
        events.append("pause")
        return pause(self, *tags)

    monkeypatch.setattr(hal.Backend, "synchronize", synchronize)
    monkeypatch.setattr(graphkit.MemorySaver, "pause", paused)
    # 15 GiB is more than 90% of the fake device's 16 GiB: left out, with the reason
    assert sleep.run_sleep_bench("fake", 0, [2 * MIB, 4 * MIB, 15 << 30], 2, tmp_path, "test", rounds=2) == 0
    text = capsys.readouterr().out
    out = json.loads((tmp_path / "bench-sleep.json").read_text())
    rows = {(r["impl"], r["bytes"], r["backup"]): r for r in out["rows"]}
    for impl in ("graphkit", "graphkit-elastic", "hal calls"):
        for nbytes in (2 * MIB, 4 * MIB):
            for backup in (False, True):
                row = rows[(impl, nbytes, backup)]
                assert row["exact"] and row["pause"]["n"] == 4 and row["first_pause"]["n"] == 2
                assert row["first_over_steady"] == pytest.approx(row["first_pause"]["median"] / row["pause_s"])
                assert row["vs_hal"] > 0
    assert not any(r["bytes"] == 15 << 30 for r in out["rows"])
    assert {(s["bytes"], s["backup"]) for s in out["skipped"]} == {(15 << 30, False), (15 << 30, True)}
    assert "needs 15.0 GiB of device memory" in text and "left out" in text and "first/steady" in text
    assert rows[("graphkit-elastic", 4 * MIB, False)]["chunks"] == 2  # two granules in eight steps: two chunks
    # every timed pause starts once the device is idle: queued work is not charged to it
    assert all(events[i - 1] == "sync" for i, e in enumerate(events) if e == "pause")
    assert events.count("pause") >= 3 * 2 * 2 * 2


def test_the_elastic_target_is_judged_against_torch_memory_saver() -> None:
    rows = [{"impl": "graphkit-elastic", "bytes": 1 << 30, "backup": False, "pause_s": 1.0, "resume_s": 1.0,
             "first_pause": {"median": 1.1}},
            {"impl": "torch_memory_saver", "bytes": 1 << 30, "backup": False, "pause_s": 0.4, "resume_s": 0.4}]
    targets = sleep.sleep_targets(rows, 2 * MIB, {"d2h": 1.0, "h2d": 1.0})
    elastic = next(t for t in targets if "2.0 x torch_memory_saver" in t["target"])
    assert elastic["limit"] == pytest.approx(1.6) and not elastic["met"]
    rows[1]["pause_s"] = 0.6
    assert next(t for t in sleep.sleep_targets(rows, 2 * MIB, {"d2h": 1.0, "h2d": 1.0})
                if "2.0 x torch_memory_saver" in t["target"])["met"]
