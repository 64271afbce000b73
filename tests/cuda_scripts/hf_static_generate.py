"""transformers' static-cache generation with a compiled forward, outside and (with --scope) inside graph_memory.

Prints the generated tokens; used to tell apart what torch does on its own from what graphkit changes.
"""

from __future__ import annotations

import argparse

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scope", action="store_true")
    parser.add_argument("--no-static-launcher", action="store_true")
    parser.add_argument("--manual-compile", action="store_true",
                        help="torch.compile the forward by hand (otherwise generate compiles it for a static cache)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="with --manual-compile: inductor (mode reduce-overhead) or cudagraphs (graph trees "
                             "over the eager kernels)")
    args = parser.parse_args()
    if args.no_static_launcher:
        torch._inductor.config.use_static_cuda_launcher = False
    config = transformers.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    if args.manual_compile:
        if args.compile_backend == "inductor":
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        else:
            model.forward = torch.compile(model.forward, backend=args.compile_backend, fullgraph=True)
    prompt = torch.randint(0, 4096, (2, 12), device="cuda")
    run = lambda: model.generate(prompt, max_new_tokens=12, do_sample=False,  # noqa: E731
                                 cache_implementation="static", pad_token_id=0)
    if args.scope:
        import graphkit

        with graphkit.graph_memory() as pools:
            tokens = run()
        pools.close()
    else:
        tokens = run()
    print("tokens", tokens.tolist())


if __name__ == "__main__":
    main()
