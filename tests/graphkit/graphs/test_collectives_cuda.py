"""NCCL collectives captured in graphs over graphkit memory, on two GPUs, under NCCL's registration settings.

Each case runs ``tests/cuda_scripts/nccl_aliasing.py`` as two ranks (see its
docstring for the phases) with one setting of ``NCCL_GRAPH_REGISTER`` and
``NCCL_CUMEM_ENABLE`` (vLLM forces the latter to 0, SGLang defaults it to 0,
NCCL's own default is on), on the cuda backend as it comes (chunks without a
shareable handle type). ``NCCL_PROTO=Simple`` makes every collective take the
protocol under which NCCL registers user buffers, and ``NCCL_DEBUG_SUBSYS=REG``
makes NCCL say what it registered: each case logs (and, with
``$HAL_COLLECTIVES_OUT`` set, saves as JSON) how many graph buffers NCCL
registered with its peer, reused from its cache or declined.
``tests/cuda_scripts/nccl_probe.py`` runs the same ranks with exportable chunks,
the combination under which NCCL does register graph memory, and reports.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from tests.paths import SCRIPTS
from tests.ranks import RankResult, explain, rank_env, run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu]

log = logging.getLogger("tests.collectives")

SCRIPT = SCRIPTS / "nccl_aliasing.py"

#: what NCCL prints (INFO, subsystem REG) when it registers graph buffers, by outcome
REGISTRATION_LINES = {
    "registered": r"IPC register(?:ing)? buffer|register success",
    "reused": r"IPC reuse buffer",
    "declined": r"failed to IPC register|Skipping (?:graph )?registration",
    "nvls_or_net": r"NVLS register|NET register|COLLNET register",
}


def findings(results: list[RankResult]) -> dict:
    """The ``FINDING`` lines of every rank, and NCCL's registration lines counted by outcome."""
    found: dict = {"ranks": [], "nccl_reg": {}}
    for r in results:
        facts = [json.loads(line.split(" ", 1)[1]) for line in r.output.splitlines() if line.startswith("FINDING ")]
        found["ranks"].append(facts)
        for outcome, pattern in REGISTRATION_LINES.items():
            count = len(re.findall(pattern, r.output))
            found["nccl_reg"][outcome] = found["nccl_reg"].get(outcome, 0) + count
    return found


def save(name: str, found: dict) -> None:
    out = os.environ.get("HAL_COLLECTIVES_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(found, indent=1))


@pytest.mark.parametrize("graph_register", ["0", "1"])
@pytest.mark.parametrize("cumem", ["0", "1"])
def test_collectives_replay_over_aliased_and_reused_graph_memory(graph_register: str, cumem: str) -> None:
    """Replays equal eager after other spaces aliased the chunks, after released ranges were taken by new spaces
    over other chunks, and after a sleep and wake (except where NCCL can hold registrations of graph memory)."""
    env = rank_env(NCCL_GRAPH_REGISTER=graph_register, NCCL_CUMEM_ENABLE=cumem, NCCL_PROTO="Simple",
                   NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="REG")
    results = run_ranks(SCRIPT, timeout=90, env=env)
    found = findings(results)
    name = f"nccl-register{graph_register}-cumem{cumem}"
    save(name, found)
    log.info("%s: %s", name, json.dumps(found))
    assert all(r.ok and f"rank {r.rank} ok" in r.output for r in results), explain(results)
    reuse = [f["reuse"] for facts in found["ranks"] for f in facts if "reuse" in f]
    assert reuse and all(x["over_released"] for x in reuse), reuse  # the case took released address ranges
    assert all(("NCCL_GRAPH_REGISTER=0" in r.output) == (graph_register == "1") for r in results)  # the sleep's warning
    if "0" in (graph_register, cumem):  # either off: NCCL registers no graph buffer of graphkit's
        assert found["nccl_reg"]["registered"] == 0, found
    # both on (NCCL's defaults): NCCL 2.28.9 registered graphkit's buffers on 2 H100s, and the replays above were
    # still right after aliasing and after address reuse; what it did is in the saved findings
