"""Observation hooks for nano-vllm test runs, active in every process that has NANOVLLM_HARNESS_OUT set.

Imported at interpreter start (this folder is on PYTHONPATH), so they reach the tensor-parallel
ranks nano-vllm spawns too. They change nothing the engine computes:

* ``ModelRunner.capture_cudagraph`` is timed and the device memory it takes is measured
  (the driver's free memory before and after), per rank, into ``rank<N>.json``, with the devices
  the rank holds a context on and the devices graphkit serves in it; beside it, what torch's caching
  allocator grew by in its default pool (workspaces made during the capture) and in its other pools
  (the graph pool), and the graphs' node count, so that the growth can be split per item;
* ``NANOVLLM_EAGER_FIRST=1`` runs one eager decode step of every capture size before the measurement starts
  (the kernels those shapes need are loaded then, as an engine's first decode steps would load them; the
  engine's own warm-up inside its capture loop loads them otherwise, and the capture's figure counts them);
* ``NANOVLLM_ORDER=ascending`` makes the engine's capture loop run smallest first (the engine
  iterates ``reversed(graph_bs)``; the module-level name is replaced); ``NANOVLLM_LARGEST_ALONE=1``
  captures the largest size only (a measurement of one graph: nothing is replayed or generated);
* ``NANOVLLM_PORT`` pins the port every rank's ``find_available_port()`` returns (each rank picks one
  independently and they can disagree);
* ``get_rope`` accepts transformers 5's ``rope_scaling`` dict of the default rope type (the engine
  asserts None there): the theta is passed on;
* ``ModelRunner.harness_check`` replays every captured graph and compares it with the eager model,
  in every rank (called through the engine's own ``call`` so that the ranks run it together).
"""

import os

if os.environ.get("NANOVLLM_HARNESS_OUT"):
    import json
    import time

    import torch
    from nanovllm.engine import model_runner as _mr
    from nanovllm.models import qwen3 as _qwen3
    from nanovllm.utils.context import reset_context, set_context

    _OUT = os.environ["NANOVLLM_HARNESS_OUT"]

    def _write(rank, **fields):
        path = os.path.join(_OUT, f"rank{rank}.json")
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data.update(fields)
        with open(path, "w") as f:
            json.dump(data, f)

    if os.environ.get("NANOVLLM_LARGEST_ALONE"):
        _mr.reversed = lambda sizes: [max(sizes)]  # the largest size only: what one graph costs
    elif os.environ.get("NANOVLLM_ORDER") == "ascending":
        _mr.reversed = lambda sizes: list(sizes)  # the capture loop's only use of reversed()

    if os.environ.get("NANOVLLM_PORT"):
        _mr.find_available_port = lambda *a, **k: int(os.environ["NANOVLLM_PORT"])

    _get_rope = _qwen3.get_rope

    def _rope(head_size, rotary_dim, max_position, base, rope_scaling=None):
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            base = rope_scaling.get("rope_theta", base)
            rope_scaling = None
        return _get_rope(head_size, rotary_dim, max_position, base, rope_scaling)

    _qwen3.get_rope = _rope

    def _contexts():
        """The devices on which this process has a context (the driver's primary context is active); None
        without cuda-python. Asking creates none."""
        try:
            from cuda.bindings import driver
        except ImportError:
            return None
        active = []
        for index in range(torch.cuda.device_count()):
            err, device = driver.cuDeviceGet(index)
            err2, _, on = driver.cuDevicePrimaryCtxGetState(device) if int(err) == 0 else (err, 0, 0)
            if int(err2) == 0 and on:
                active.append(index)
        return active

    def _served():
        """The devices graphkit serves in this process (the switch's pools, the port's pools), or None."""
        import sys

        switch = sys.modules.get("graphkit.switch")
        scope = switch.active() if switch is not None else None
        return sorted(f"{b}:{d}" for b, d in scope.pools) if scope is not None else None

    def _segments():
        """Bytes of torch's caching allocator, split into its default pool and every other pool (graph pools,
        graphkit's pools: their virtual reservations)."""
        default = other = 0
        for segment in torch.cuda.memory_snapshot():
            if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0):
                default += segment["total_size"]
            else:
                other += segment["total_size"]
        return default, other

    def _nodes(graphs):
        """Kernel and other nodes of the captured graphs (cuGraphGetNodes), or None where it cannot be read."""
        try:
            from cuda.bindings import driver

            total = 0
            for graph in graphs:
                err, _, count = driver.cuGraphGetNodes(driver.CUgraph(graph.raw_cuda_graph()), 0)
                if int(err):
                    return None
                total += count
            return total
        except Exception:  # noqa: BLE001 -- an older torch (no raw_cuda_graph) or no cuda-python: the figure is left out
            return None

    def _served_chunks():
        """This device's chunks under the switch (all, and those under memory that outlived its capture), or
        None where the switch does not serve it."""
        import sys

        switch = sys.modules.get("graphkit.switch")
        scope = switch.active() if switch is not None else None
        pools = scope.pools.get(("cuda", torch.cuda.current_device())) if scope is not None else None
        if pools is None:
            return None
        report = pools.report(measure=False)
        return {"chunk_bytes": report.chunk_bytes, "survivor_bytes": report.survivor_bytes}

    def _served_pools(runner):
        """The graphkit pools serving this rank's device: the port's, the switch's, or a scope's (found among the
        live objects: the block's pools are the caller's), or None."""
        import gc
        import sys

        pools = getattr(runner, "graphkit_pools", None)
        if pools is not None:
            return pools
        switch = sys.modules.get("graphkit.switch")
        scope = switch.active() if switch is not None else None
        if scope is not None:
            return scope.pools.get(("cuda", torch.cuda.current_device()))
        graphkit = sys.modules.get("graphkit")
        if graphkit is None:
            return None
        return next((o for o in gc.get_objects() if isinstance(o, graphkit.GraphPools) and not o.closed
                     and o.backend.device == torch.cuda.current_device()), None)

    def _executables(runner):
        """This device's executables budget after the check (graphkit's pools, scope or switch), or None."""
        pools = _served_pools(runner)
        stats = pools.executables.stats if pools is not None and pools.executables is not None else None
        if stats is None:
            return None
        return {"executables": stats.executables, "topologies": stats.topologies, "graphs": stats.graphs,
                "instantiations": stats.instantiations, "updates": stats.updates, "refused": stats.refused,
                "own": stats.own, "driver_bytes": stats.driver_bytes}

    _capture = _mr.ModelRunner.capture_cudagraph

    @torch.inference_mode()
    def _eager_decode(self, bs, gen):
        """One eager decode step of ``bs`` rows through the model (random ids, the harness's context)."""
        vocab = self.config.hf_config.vocab_size
        ids = torch.randint(0, vocab, (bs,), generator=gen).cuda()
        pos = torch.randint(0, 8, (bs,), generator=gen).cuda()
        slots = torch.full((bs,), -1, dtype=torch.int32, device="cuda")
        lens = torch.ones(bs, dtype=torch.int32, device="cuda")
        width = -(-self.config.max_model_len // self.block_size)
        tables = torch.zeros(bs, width, dtype=torch.int32, device="cuda")
        set_context(False, slot_mapping=slots, context_lens=lens, block_tables=tables)
        out = self.model(ids, pos)
        reset_context()
        return ids, pos, slots, lens, tables, out

    def _measured_capture(self):
        if os.environ.get("NANOVLLM_EAGER_FIRST"):  # every decode size once eagerly: kernels loaded before capture
            gen = torch.Generator().manual_seed(7)
            max_bs = min(self.config.max_num_seqs, 512)
            for bs in [1, 2, 4, 8, *range(16, max_bs + 1, 16)]:
                self._eager_decode(bs, gen)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info()
        self._harness_free0 = free0  # the check measures again once every graph was replayed
        default0, other0 = _segments()
        start = time.perf_counter()
        profile = os.environ.get("NANOVLLM_PROFILE")
        if profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            result = profiler.runcall(_capture, self)
            with open(f"{profile}.rank{self.rank}.txt", "w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
        else:
            result = _capture(self)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        free1, _ = torch.cuda.mem_get_info()
        default1, other1 = _segments()
        pools = getattr(self, "graphkit_pools", None)
        _write(self.rank, device=torch.cuda.current_device(), graph_bytes=free0 - free1, capture_s=seconds,
               torch_default_bytes=default1 - default0, torch_pool_bytes=other1 - other0,
               graphs=len(self.graphs), graph_nodes=_nodes(self.graphs.values()),
               served_chunks=_served_chunks(),
               sizes=sorted(self.graphs), order=os.environ.get("NANOVLLM_ORDER", "descending"),
               pools_report=str(pools.report()) if pools is not None else None, contexts=_contexts(),
               served=_served(), pools_device=pools.backend.device if pools is not None else None)
        return result

    _mr.ModelRunner.capture_cudagraph = _measured_capture
    _mr.ModelRunner._eager_decode = _eager_decode

    @torch.inference_mode()
    def harness_check(self, seed):
        """Each graph replayed (in a shuffled order, after all were captured) against the eager model."""
        gen = torch.Generator().manual_seed(seed)
        v = self.graph_vars
        worst = {}
        order = torch.randperm(len(self.graph_bs), generator=gen).tolist()
        for i in order:
            bs = self.graph_bs[i]
            ids, pos, _, lens, _, eager = self._eager_decode(bs, gen)
            eager = eager.float()
            v["input_ids"][:bs] = ids
            v["positions"][:bs] = pos
            v["slot_mapping"].fill_(-1)
            v["context_lens"].zero_()
            v["context_lens"][:bs] = lens
            v["block_tables"].zero_()
            self.graphs[bs].replay()
            torch.cuda.synchronize()
            diff = (v["outputs"][:bs].float() - eager).abs().max().item()
            worst[str(bs)] = diff / max(eager.abs().max().item(), 1e-6)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager model's temporaries: cached by torch, not the graphs'
        free2, _ = torch.cuda.mem_get_info()
        _write(self.rank, check_relative_error=worst, graph_bytes_replayed=self._harness_free0 - free2,
               executables=_executables(self))
        return max(worst.values())

    _mr.ModelRunner.harness_check = harness_check
