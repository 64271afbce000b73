"""The KV sizing bench: a KV cache sized after capture against one sized before it from an estimate."""

from __future__ import annotations

import json
from pathlib import Path

import hal


def test_the_kv_sizing_bench_reports_both_approaches_and_an_estimate_that_runs_out(tmp_path: Path) -> None:
    """After capture: the memory left less the margin, no OOM. Before, from an estimate: less KV when the
    estimate is high; out of memory at capture when it misses the graphs and the margin cannot take them."""
    from graphkit_bench import kv_sizing

    rc = kv_sizing.run_kv_sizing_bench("fake", 0, "tiny", [1, 2, 4, 8], 1, 1 << 20, 2 << 20, 0, False, tmp_path,
                                       "test")
    out = json.loads((tmp_path / "bench-kv-sizing.json").read_text())
    assert rc == 0 and out["case_order"] == "alternated"
    est, after = (next(r for r in out["results"] if r["approach"] == a) for a in ("estimate", "after-capture"))
    assert est["estimate_bytes"] == 2 << 20 and est["estimate_source"] == "given"
    assert est["oom"] is None and after["oom"] is None and est["tokens_equal"] and after["tokens_equal"]
    assert after["graph_memory_bytes"] > 0 and after["kv_bytes"] > est["kv_bytes"] > 0
    assert after["headroom_kept"] and 1 << 20 <= after["free_after_bytes"] < (1 << 20) + 4 * (1 << 14)
    assert out["targets"][0]["met"] is True

    with hal.get_backend("fake", **kv_sizing.FAKE_OPTIONS) as be:
        starved = kv_sizing.run_kv_case("estimate", be, "tiny", [1, 2, 4, 8], margin=1 << 14)
        assert starved["estimate_source"] == "profile" and starved["estimate_bytes"] == 0  # activations on the host
        assert starved["oom"] is not None and "DeviceOutOfMemoryError" in starved["oom"]
        assert starved["tokens_equal"] is None and not starved["headroom_kept"]
        sized = kv_sizing.run_kv_case("after-capture", be, "tiny", [1, 2, 4, 8], margin=1 << 14)
        assert sized["oom"] is None and sized["tokens_equal"] and sized["headroom_kept"]
        assert be.live.zero, be.live
