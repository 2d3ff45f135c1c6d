"""Self-filter a factual-QA set to the current model's learning zone (data/self_filter.py's rule: keep a
question when k of G sampled answers are judged right, min_correct <= k <= max_correct), sampling with the
project's transformers engine. The sampling lives here, not in data/: data/ is rows and knows no model.

    python -m launch.self_filter --input nq.jsonl --out nq_zone.jsonl --group-size 8
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from data.rows import read_rows, write_rows
from data.self_filter import GenerateFn, check_settings, load_judge, self_filter


def engine_generate_fn(
    model: str | None, *, max_new_tokens: int, temperature: float, top_p: float, seed: int
) -> GenerateFn:
    """A generate_fn backed by the project's transformers engine; its prompts are chat messages as JSON text.

    Use it with `render=json.dumps` so each prompt is rendered through the model's own chat template
    (system prompt included) and tokenised exactly once.
    """
    import models
    from rollout.hf_engine import HFEngine

    tokenizer = models.load_tokenizer(model)
    engine = HFEngine(models.load_model(model), tokenizer)
    calls = 0

    def generate(prompts: list[str], n: int) -> list[list[str]]:
        nonlocal calls
        prompt_ids = [models.render_prompt(tokenizer, json.loads(prompt)) for prompt in prompts]
        # A different seed per call: the same seed for every batch would correlate the samples across batches.
        completions = engine.generate(
            prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=0, stop=None, seed=seed + calls,
        )
        calls += 1
        texts = [completion.text for completion in completions]
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate


def filter_command(args: argparse.Namespace) -> None:

    rows = read_rows(args.input)
    # Settings and judge are checked before the model loads, so a typo fails in a second, not after a minute.
    check_settings(args.group_size, args.min_correct, args.max_correct, args.anchors, args.batch_size)
    judge_fn = load_judge(args.judge)
    generate_fn = engine_generate_fn(
        args.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    kept, stats = self_filter(
        rows, generate_fn, judge_fn,
        group_size=args.group_size, min_correct=args.min_correct, max_correct=args.max_correct,
        anchors=args.anchors, batch_size=args.batch_size, seed=args.seed, render=json.dumps,
    )
    if not kept:
        raise ValueError(f"no question was answered correctly between {stats['min_correct']} and "
                         f"{stats['max_correct']} times out of {args.group_size}; nothing to write ({stats})")
    write_rows(kept, Path(args.out))
    print(f"{args.out}: kept {len(kept)} of {len(rows)} rows {stats}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.self_filter", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="factqa rows (.jsonl or .parquet)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="model directory or HF id in the local cache; default: embedded")
    parser.add_argument("--group-size", type=int, default=8, help="completions sampled per question (G)")
    parser.add_argument("--min-correct", type=int, default=1)
    parser.add_argument("--max-correct", type=int, default=None, help="default: G-1")
    parser.add_argument("--anchors", type=int, default=0, help="also keep this many always-correct questions")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16, help="questions per generate call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge", default="rewards.factqa:judge",
                      help="module:function judging (completion_text, ground_truth): bool, or a number > 0 if right")
    args = parser.parse_args(argv)
    try:
        filter_command(args)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
