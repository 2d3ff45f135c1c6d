"""The update's forward + backward on a micro-batch of uneven completion lengths, by the three passes of
models.logprobs.completion_logprobs and the block-diagonal-mask alternative to packed attention:

    python -m bench.packed                       # SmolLM2-135M, 2 prompts x G=4, completions of 8..256 tokens
    python -m bench.packed --group 1 --prompts 8 # distinct prompts (nothing to share)
    python -m bench.packed --quick               # smoke run: tiny random model, lengths 8..32, one round

- padded: pad_batch's layout, B x (Lp + T) tokens (share_prompts=False);
- shared: each distinct prompt once, completions on its KV cache, still padded to T (the trainer's default);
- packed: one padding-free row, each distinct prompt once, per-segment attention (packed=True);
- block mask: the same packed row through sdpa with one [N, N] block mask (segment_mask below), the
  alternative the packed pass was measured against.
Passes alternate A B C D, D C B A, ... for --rounds rounds after one warm-up each; the table gives the median
seconds, min/max, tokens each pass computes, and the largest logprob difference from the padded pass.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.report import write_results

PASSES = ("padded", "shared", "packed", "block mask")


def uneven_batch(tokenizer, prompts: int, group: int, low: int, high: int, seed: int) -> dict:
    """P synthetic-task prompts (~200 tokens, as bench.step), each with G completions of random lengths in
    [low, high] (random token ids: the pass's cost does not depend on them)."""
    from data.synthetic import generate_rows
    from models import render_prompt
    from models.logprobs import pad_batch

    generator = torch.Generator().manual_seed(seed)
    rows = generate_rows(max(prompts, 8), seed=seed)[:prompts]
    prompt_ids = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    lengths = torch.randint(low, high + 1, (prompts * group,), generator=generator).tolist()
    completions = [torch.randint(3, 49000, (n,), generator=generator).tolist() for n in lengths]
    return pad_batch([p for p in prompt_ids for _ in range(group)], completions, tokenizer.pad_token_id)


def segment_mask(segments, num_tokens: int, device=None) -> torch.Tensor:
    """The packed row's attention pattern (models.attention) as one [1, 1, N, N] bool mask (True = attend): the
    block-diagonal alternative to per-segment attention, and the reference tests/test_models_packing.py uses."""
    mask = torch.zeros(num_tokens, num_tokens, dtype=torch.bool, device=device)
    for start, end, prefix_start, prefix_end in segments:
        mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()
        mask[start:end, prefix_start:prefix_end] = True
    return mask[None, None]


def block_mask_logprobs(model, batch: dict):
    """Logprobs [M] of the packed row run through the model's sdpa with the block mask as a 4-D mask."""
    from models.logprobs import LogprobsFromHidden
    from models.logprobs import pack_batch, prompt_groups

    _, prompt_index = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["prompt_len"])
    packed = pack_batch(batch, prompt_index)
    mask = segment_mask(packed.segments, packed.input_ids.shape[1])
    hidden = model.get_decoder()(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                 attention_mask=mask, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    logprobs, _ = LogprobsFromHidden.apply(hidden[0, packed.predict_index], head.weight, head.bias, packed.labels,
                                           1.0, 512, False)
    return logprobs, packed.input_ids.shape[1]


def run_pass(model, batch: dict, name: str):
    """One forward + backward; returns (seconds, logprobs of the real completion tokens [M], tokens computed)."""
    from models.logprobs import completion_logprobs, prompt_groups

    model.zero_grad(set_to_none=True)
    mask = batch["completion_mask"] > 0
    started = time.perf_counter()
    if name == "block mask":
        logprobs, tokens = block_mask_logprobs(model, batch)
    else:
        values, _ = completion_logprobs(model, batch, share_prompts=name != "padded", packed=name == "packed")
        logprobs = values[mask]
        rows, width = batch["input_ids"].shape
        unique, _ = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["prompt_len"])
        tokens = {"padded": rows * width,
                  "shared": len(unique) * batch["prompt_len"] + rows * (width - batch["prompt_len"]),
                  "packed": None}[name]
    logprobs.sum().backward()
    seconds = time.perf_counter() - started
    if tokens is None:  # packed: count what pack_batch laid out
        from models.logprobs import pack_batch

        _, index = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["prompt_len"])
        tokens = pack_batch(batch, index).input_ids.shape[1]
    return seconds, logprobs.detach(), tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny random model, lengths 8..32, 1 round")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.tiny import tiny_model
    from models import load_model, load_tokenizer

    if args.quick:
        args.max_len, args.rounds = min(args.max_len, 32), 1
    tokenizer = load_tokenizer(None)
    model = tiny_model("llama") if args.quick else load_model(None)
    model.train()
    batch = uneven_batch(tokenizer, args.prompts, args.group, args.min_len, args.max_len, args.seed)
    times = {name: [] for name in PASSES}
    results = {}
    for name in PASSES:  # warm-up, and the reference values
        results[name] = run_pass(model, batch, name)
    for round_index in range(args.rounds):
        for name in PASSES if round_index % 2 == 0 else PASSES[::-1]:
            seconds, logprobs, tokens = run_pass(model, batch, name)
            times[name].append(seconds)
            results[name] = (seconds, logprobs, tokens)
    reference = results["padded"][1]
    lengths = batch["completion_mask"].sum(dim=1).int().tolist()
    prompt_lengths = batch["attention_mask"][:: args.group, : batch["prompt_len"]].sum(dim=1).tolist()
    report = {"settings": {**vars(args), "completion_lengths": lengths, "prompt_len": batch["prompt_len"],
                           "prompt_lengths": prompt_lengths,
                           "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()},
              "passes": {}}
    print(f"{args.prompts} prompts x G={args.group}, prompt {batch['prompt_len']} tokens, completions "
          f"{min(lengths)}..{max(lengths)} (mean {statistics.mean(lengths):.0f}), {args.rounds} round(s), "
          f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print(f"{'pass':<11} {'median s':>9} {'min':>7} {'max':>7} {'tokens':>7} {'vs padded':>9} {'max |dlogprob|':>15}")
    padded_median = statistics.median(times["padded"])
    for name in PASSES:
        median = statistics.median(times[name])
        difference = (results[name][1] - reference).abs().max().item()
        report["passes"][name] = {"seconds": times[name], "median_seconds": median, "tokens": results[name][2],
                                  "max_abs_logprob_diff_vs_padded": difference}
        print(f"{name:<11} {median:>9.2f} {min(times[name]):>7.2f} {max(times[name]):>7.2f} {results[name][2]:>7} "
              f"{padded_median / median:>8.2f}x {difference:>15.2e}")
    if args.out:
        write_results(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
