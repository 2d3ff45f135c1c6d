"""Self-filter a factual-QA set to the current model's learning zone: keep the questions it answers right sometimes.

    python -m launch.self_filter --input nq.jsonl --out nq_zone.jsonl --group-size 8

A question the model always gets right (or never) gives a GRPO group with equal rewards and no gradient, so a
question is kept when k of G sampled answers are judged correct, `min_correct <= k <= max_correct` (default 1
and G-1). Optional "anchors" add back a few always-correct questions, reported to stabilise 3B/4B training."""
from __future__ import annotations

import argparse
import copy
import functools
import itertools
import random
from pathlib import Path
from typing import Callable

from data.jsonio import exit_on_bad_input
from data.rows import read_rows, write_rows
from launch.eval import add_engine_arguments, engine_from_args, resolve_model
from models import render_prompt
from rewards import load_function

GenerateFn = Callable[[list, int], list[list[str]]]
JudgeFn = Callable[[str, str], bool]


def check_settings(group_size: int, min_correct: int, max_correct: int | None, anchors: int, batch_size: int) -> int:
    """Validate the filter's settings (before any model loads); returns max_correct, its default G-1 filled in."""
    max_correct = group_size - 1 if max_correct is None else max_correct
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if not 0 <= min_correct <= max_correct <= group_size:
        raise ValueError(f"need 0 <= min_correct <= max_correct <= group_size, got {min_correct}, {max_correct}, "
                         f"{group_size}")
    if anchors < 0 or batch_size < 1:
        raise ValueError(f"anchors must be >= 0 and batch_size >= 1, got {anchors} and {batch_size}")
    return max_correct


def self_filter(rows: list[dict], generate_fn: GenerateFn, judge_fn: JudgeFn, *, group_size: int = 8,
                min_correct: int = 1, max_correct: int | None = None, anchors: int = 0, batch_size: int = 16,
                seed: int = 0, render: Callable[[list[dict]], object]) -> tuple[list[dict], dict]:
    """Keep the rows answered correctly k of G times, min_correct <= k <= max_correct, and `anchors` rows with
    k = G chosen under `seed` (all if fewer). generate_fn(prompts, n): the n = G completion texts of each prompt
    (render(row["prompt"])); judge_fn(text, ground_truth): whether one is correct. Returns (kept rows in input
    order, each a copy with extra_info["self_filter"] = {"correct": k, "samples": G, "anchor": bool}, stats)."""
    max_correct = check_settings(group_size, min_correct, max_correct, anchors, batch_size)
    correct_counts: list[int] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        completions = generate_fn([render(row["prompt"]) for row in batch], group_size)
        sizes = [len(texts) for texts in completions]
        if sizes != [group_size] * len(batch):  # zip would silently drop a missing prompt or completion
            raise ValueError(f"generate_fn returned {sizes} completions for the {len(batch)} prompts from row {start}; "
                             f"expected {group_size} each")
        for row, texts in zip(batch, completions):
            correct_counts.append(sum(bool(judge_fn(text, row["reward_model"]["ground_truth"])) for text in texts))

    in_zone = {i for i, k in enumerate(correct_counts) if min_correct <= k <= max_correct}
    always_right = sorted(i for i, k in enumerate(correct_counts) if k == group_size and i not in in_zone)
    chosen_anchors = set(random.Random(seed).sample(always_right, min(anchors, len(always_right))))
    kept = []
    for i in sorted(in_zone | chosen_anchors):
        row = copy.deepcopy(rows[i])
        row["extra_info"] = {**(row.get("extra_info") or {}), "self_filter": {
            "correct": correct_counts[i], "samples": group_size, "anchor": i in chosen_anchors}}
        kept.append(row)
    stats = {"total": len(rows), "kept": len(kept), "in_zone": len(in_zone), "anchors": len(chosen_anchors),
             "min_correct": min_correct, "max_correct": max_correct,
             "correct_histogram": [correct_counts.count(k) for k in range(group_size + 1)]}
    return kept, stats


def load_judge(spec: str) -> JudgeFn:
    """The judge named `module:function`, a function (completion_text, ground_truth) -> bool or a number: correct
    when it returns True or a number > 0 (rewards.factqa.judge, the factual-QA string-match judge)."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"--judge {spec!r} must look like module:function")
    try:
        function = load_function(spec)
    except ValueError as error:
        raise ValueError(f"--judge {spec!r} cannot be loaded: {error}") from None

    def judge(text: str, ground_truth: str) -> bool:
        result = function(text, ground_truth)
        if not isinstance(result, (int, float)):  # bool included: True > 0
            raise ValueError(f"judge {spec!r} returned {type(result).__name__}; expected bool or a number")
        return result > 0

    return judge


def engine_generate_fn(engine, *, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> GenerateFn:
    """A generate_fn on an engine, each call with the next seed (one seed for every batch would correlate them)."""
    seeds = itertools.count(seed)

    def generate(prompts: list[list[int]], n: int) -> list[list[str]]:
        completions = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, top_k=0, stop=None, seed=next(seeds))
        texts = [completion.text for completion in completions]
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate


@exit_on_bad_input()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.self_filter", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="factqa rows (.jsonl or .parquet)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="default", help="model directory, run directory, 'default', or org/name")
    parser.add_argument("--group-size", type=int, default=8, help="completions sampled per question (G)")
    parser.add_argument("--min-correct", type=int, default=1)
    parser.add_argument("--max-correct", type=int, default=None, help="default: G-1")
    parser.add_argument("--anchors", type=int, default=0, help="also keep this many always-correct questions")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16, help="questions per generate call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge", default="rewards.factqa:judge", help="module:function, as load_judge reads it")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    rows = read_rows(args.input)
    check_settings(args.group_size, args.min_correct, args.max_correct, args.anchors, args.batch_size)
    judge_fn = load_judge(args.judge)
    engine, tokenizer, _ = engine_from_args(args, resolve_model(args.model))
    generate_fn = engine_generate_fn(engine, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed)
    kept, stats = self_filter(rows, generate_fn, judge_fn, group_size=args.group_size, min_correct=args.min_correct,
                              max_correct=args.max_correct, anchors=args.anchors, batch_size=args.batch_size,
                              seed=args.seed, render=functools.partial(render_prompt, tokenizer))
    if not kept:
        raise ValueError(f"no question was answered correctly between {stats['min_correct']} and "
                         f"{stats['max_correct']} times out of {args.group_size}; nothing to write ({stats})")
    write_rows(kept, Path(args.out))
    print(f"{args.out}: kept {len(kept)} of {len(rows)} rows {stats}")


if __name__ == "__main__":
    main()
