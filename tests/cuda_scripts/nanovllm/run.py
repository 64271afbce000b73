"""Start nano-vllm (its source untouched) on a random-weight Qwen3-0.6B-shaped checkpoint, one adoption mode.

    python tests/cuda_scripts/nanovllm/run.py --mode own|scope|port|switch --order descending|ascending \
        [--tp 2] --out DIR

* ``own``: the engine as it is (its one shared pool);
* ``scope``: ``with graphkit.graph_memory() as pools: llm = LLM(...)`` around the engine's start;
* ``port``: a copy of the engine package with the README's one-line port applied (``pool=pools.pool(bs)``,
  the pools kept on the runner), nothing else changed;
* ``switch``: the engine as it is, started with ``GRAPHKIT_GRAPH_MEMORY=1`` in the environment.

The engine captures its decode graphs for 8 batch sizes (1..64). Afterwards every rank replays each
graph against its eager model (``harness_check``, see sitecustomize.py); at TP=1 the engine also
generates. Each rank writes ``rank<N>.json`` into ``--out`` (graph memory measured by the driver,
capture seconds, the check); this process prints one ``RESULT {json}`` line with all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: the one-line port of the README, applied to nano-vllm's capture loop (plus the import and the pools it keeps)
PORT = [("import torch\n", "import torch\nimport graphkit\n", 1),
        ("        self.graph_pool = None\n",
         "        self.graph_pool = None\n        self.graphkit_pools = graphkit.GraphPools()\n", 1),
        ("with torch.cuda.graph(graph, self.graph_pool):",
         "with torch.cuda.graph(graph, pool=self.graphkit_pools.pool(bs)):", 1)]
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=False)


def checkpoint(path: str) -> str:
    """A random-weight Qwen3-0.6B-shaped checkpoint at ``path`` (written once)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_06B, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def ported_copy(into: str) -> str:
    """A copy of the installed nano-vllm with the one-line port applied; returns the folder to put on the path."""
    import importlib.util

    spec = importlib.util.find_spec("nanovllm")
    source = next(iter(spec.submodule_search_locations))
    target = os.path.join(into, "nanovllm")
    shutil.copytree(source, target)
    runner = os.path.join(target, "engine", "model_runner.py")
    with open(runner) as f:
        text = f.read()
    for old, new, count in PORT:
        if text.count(old) < count:
            raise SystemExit(f"the port does not apply to this nano-vllm: {old!r} not found")
        text = text.replace(old, new, count)
    with open(runner, "w") as f:
        f.write(text)
    return into


class Tokenizer:
    """The engine asks a tokenizer for the end-of-sequence id and to decode; prompts are token ids here."""

    eos_token_id = 151645

    def decode(self, ids):
        return " ".join(map(str, ids))


def _wait_for_ranks(out: str, ranks: int, field: str, timeout: float = 60.0) -> None:
    """Wait until every rank's file has ``field`` (rank 0 returns from a call before the others are done)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = 0
        for rank in range(ranks):
            try:
                with open(os.path.join(out, f"rank{rank}.json")) as f:
                    found += field in json.load(f)
            except (OSError, ValueError):
                pass
        if found == ranks:
            return
        time.sleep(0.2)


def start(args: argparse.Namespace) -> dict:
    import torch
    from nanovllm import LLM, SamplingParams

    kwargs = dict(tensor_parallel_size=args.tp, max_num_seqs=64, max_model_len=256, max_num_batched_tokens=4096,
                  gpu_memory_utilization=0.6, tokenizer=Tokenizer())
    report = chunks = None
    if args.mode == "scope":
        import graphkit

        with graphkit.graph_memory() as pools:
            llm = LLM(args.model, **kwargs)
        figures = pools.report()
        report = str(figures)
        chunks = {"chunk_bytes": figures.chunk_bytes, "survivor_bytes": figures.survivor_bytes}
    else:
        llm = LLM(args.model, **kwargs)
    result = {"mode": args.mode, "order": args.order, "tp": args.tp, "scope_report": report, "scope_chunks": chunks}
    if args.largest_alone or args.measure_only:
        return result
    result["check_worst"] = llm.model_runner.call("harness_check", 1234)
    _wait_for_ranks(args.out, args.tp, "check_relative_error")  # the other ranks may still be writing theirs
    if args.tp == 1:
        prompts = [[int(t) for t in torch.randint(0, 151936, (n,))] for n in (5, 17, 33, 64)]
        outputs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
        result["generated"] = [len(o["token_ids"]) for o in outputs]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("own", "scope", "port", "switch"), required=True)
    parser.add_argument("--order", choices=("descending", "ascending"), default="descending")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/graphkit-tests/qwen3-0.6b-random"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--largest-alone", action="store_true", help="capture the largest size only (a measurement)")
    parser.add_argument("--measure-only", action="store_true", help="start the engine; no check, no generation")
    args = parser.parse_args()
    if os.environ.get("NANOVLLM_HARNESS_OUT") is None:  # the launcher: prepare, then run itself with the hooks on
        os.makedirs(args.out, exist_ok=True)
        checkpoint(args.model)
        env = dict(os.environ, NANOVLLM_HARNESS_OUT=args.out, NANOVLLM_ORDER=args.order,
                   NANOVLLM_PORT=str(args.port), PYTHONUNBUFFERED="1")
        path = [HERE]
        tmp = tempfile.mkdtemp(prefix="nanovllm-port-")
        if args.mode == "port":
            path.insert(0, ported_copy(tmp))
        if args.mode == "switch":
            env["GRAPHKIT_GRAPH_MEMORY"] = "1"
        if args.largest_alone:
            env["NANOVLLM_LARGEST_ALONE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
        try:
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, timeout=args_timeout())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return done.returncode
    result = start(args)
    ranks = {}
    for name in sorted(os.listdir(args.out)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(args.out, name)) as f:
                ranks[name[4:-5]] = json.load(f)
    result["ranks"] = ranks
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def args_timeout() -> float:
    return float(os.environ.get("NANOVLLM_TIMEOUT", "420"))


if __name__ == "__main__":
    sys.exit(main())
