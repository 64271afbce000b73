"""Every PyTorch capture path inside graphkit's scope, on a GPU: torch.compile's CUDA graph trees,
make_graphed_callables, transformers' static-cache generation; and a failing engine process exits cleanly."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import graphkit
import hal
from tests.paths import SCRIPTS

pytestmark = pytest.mark.cuda

SCRIPTS = SCRIPTS


@pytest.fixture
def be():
    backend = hal.get_backend("cuda")
    yield backend
    backend.close()


def _mlp(width: int = 1024, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(width, 4 * width, device="cuda", dtype=dtype, generator=gen) / width ** 0.5
    w2 = torch.randn(4 * width, width, device="cuda", dtype=dtype, generator=gen) / (4 * width) ** 0.5

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(x @ w1) @ w2

    return f


@pytest.mark.slow  # torch.compile: tens of seconds per case
@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_torch_compile_reduce_overhead_inside_the_scope(be: hal.Backend, order: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()
    f = _mlp()
    compiled = torch.compile(f, mode="reduce-overhead", dynamic=False)
    sizes = [16, 8, 4, 2, 1] if order == "descending" else [1, 2, 4, 8, 16]
    inputs = {n: torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16) for n in sizes}
    torch.cuda.synchronize()
    used0 = torch.cuda.memory_allocated()
    with caplog.at_level(logging.INFO, logger="graphkit.graphs"), graphkit.graph_memory(be) as pools:
        for _ in range(3):  # warm-up, record, replay
            for n in sizes:
                got = compiled(inputs[n]).clone()
                torch.testing.assert_close(got, f(inputs[n]), rtol=0.1, atol=0.1)
    torch.cuda.synchronize()
    assert any("graph trees" in r.getMessage() for r in caplog.records)
    assert pools.keys == []  # left to torch: its own pool, its own memory accounting
    # replays after the scope are still right
    for n in sizes:
        x = torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x).clone(), f(x), rtol=0.1, atol=0.1)
    logging.getLogger(__name__).info("torch.compile %s: memory_allocated +%d MiB", order,
                                     (torch.cuda.memory_allocated() - used0) >> 20)
    pools.close()
    torch._dynamo.reset()


def test_make_graphed_callables_inside_the_scope(be: hal.Backend) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    reference = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    reference.load_state_dict(model.state_dict())
    sample = torch.randn(32, 256, device="cuda", requires_grad=True)
    with graphkit.graph_memory(be, verify=True) as pools:
        graphed = torch.cuda.make_graphed_callables(model, (sample,))
    assert len(pools.keys) == 1 and pools.keys[0][0] == "make_graphed_callables"
    if be.supports("graph_addresses"):
        assert pools.report().verified_graphs == 2  # forward and backward, one space, checked
    for _ in range(3):
        x = torch.randn(32, 256, device="cuda", requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        graphed(x).square().sum().backward()
        reference(x_ref).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-3, atol=1e-3)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)
            p.grad = q.grad = None
    del graphed
    torch.cuda.synchronize()
    pools.close()


@pytest.mark.slow  # a model, and torch.compile
def test_transformers_static_cache_generation_inside_the_scope(be: hal.Backend) -> None:
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    config = transformers.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    # CUDA graph trees over the eager kernels: inductor's generated kernels crash this model in torch 2.11 on
    # an H100 without graphkit too (tests/cuda_scripts/hf_static_generate.py shows it); the trees are what
    # meets graphkit's scope either way
    model.forward = torch.compile(model.forward, backend="cudagraphs", fullgraph=True)
    prompt = torch.randint(0, 4096, (2, 12), device="cuda")

    def generate() -> torch.Tensor:
        return model.generate(prompt, max_new_tokens=12, do_sample=False, cache_implementation="static",
                              pad_token_id=0)

    outside = generate()
    with graphkit.graph_memory(be) as pools:
        inside = generate()
    assert torch.equal(inside, outside) and inside.shape == (2, 24)
    pools.close()
    torch._dynamo.reset()


def test_a_failing_engine_process_exits_with_the_exceptions_code() -> None:
    root = str(SCRIPTS.parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(SCRIPTS / "exit_with_error.py")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert "this exception must end the process" in done.stderr
    assert done.returncode == 1, f"exit code {done.returncode}:\n{done.stderr[-4000:]}"
