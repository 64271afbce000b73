"""What NCCL does with graph memory it can register: two ranks of nccl_aliasing.py in --probe mode, summarised.

``python -m tests.cuda_scripts.nccl_probe`` from the project root, on a machine with two GPUs. Runs the ranks
with NCCL_GRAPH_REGISTER=1, NCCL_CUMEM_ENABLE=1 and NCCL_PROTO=Simple, once with exportable chunks
(``shareable=True``: NCCL can export them to its peer) and once without (as the cuda backend comes), and prints
one JSON line per run: NCCL's version, its registration lines counted by outcome, how many graphs differed from
eager in each phase, and how each rank ended (killed: it hung past the deadline). It asserts nothing: its output
is what the documentation's account of NCCL's registration of graph memory rests on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.graphkit.graphs.test_collectives_cuda import SCRIPT, findings
from tests.ranks import rank_env, run_ranks


def main() -> None:
    timeout = float(os.environ.get("HAL_PROBE_TIMEOUT", "90"))
    for shareable in ("1", "0"):
        env = rank_env(NCCL_GRAPH_REGISTER="1", NCCL_CUMEM_ENABLE="1", NCCL_PROTO="Simple", NCCL_DEBUG="INFO",
                       NCCL_DEBUG_SUBSYS="REG", HAL_TEST_SHAREABLE=shareable)
        results = run_ranks(SCRIPT, timeout=timeout, env=env, args=["--probe"])
        found = findings(results)
        found["shareable"] = shareable == "1"
        found["ended"] = ["killed" if r.returncode is None else f"exit {r.returncode}" for r in results]
        found["last_phase"] = [next((line for line in reversed(r.output.splitlines()) if line.startswith("PHASE")),
                                    None) for r in results]
        found["errors"] = [[line for line in r.output.splitlines() if "Error" in line or "WARN" in line][-5:]
                           for r in results]
        print(json.dumps(found), flush=True)
        out = os.environ.get("HAL_COLLECTIVES_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"probe-shareable{shareable}.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    sys.exit(main())
