"""Distil a short chain-of-thought verifier SFT set from a teacher model by rejection sampling.

    python -m launch.distill --teacher Qwen/Qwen3-8B --input judgments.jsonl --out data_out/verifier/sft.jsonl \\
        --samples 4 --max-reasoning-tokens 256 --engine vllm                     # GPUs
    python -m launch.distill --teacher default --input data/fixtures/verifier_sample.jsonl --out /tmp/sft.jsonl \\
        --samples 2 --max-new-tokens 64                                          # CPU, the embedded model

The input is data.verifier's judgments JSONL ({question, gold_answer, llm_response, gold_judgment}); each row's
verifier prompt goes to the teacher K times (--samples, sampled at --temperature), every sample goes through
data.distill's filters (gold judgment, concluding summary of a thinking teacher, structure, length), and the
kept ones become SFT rows (reasoning + `Final Judgment: \\boxed{X}`) with a report of the count per reason
(OUT with the suffix .report.json). Train on them with launch/configs/verifier_sft.yaml, then DAPO with
launch/configs/verifier_dapo.yaml.

Why here and not `python -m data.distill`: sampling needs a model and an engine, and data/ may import neither
(jobs that sample live in launch/: docs/conventions.md, "Where code lives"); data/distill.py holds the filters
and the row writing, this module only generates.
"""
from __future__ import annotations

import argparse
import sys

import torch

from data.distill import DistillReport, distill_example, write_distilled, write_report
from data.verifier import convert_verifier, rebalance
from launch.eval import add_engine_arguments, exit_2_on_bad_input, load_engine, resolve_model


def sample_teacher(engine, prompt_ids: list[list[int]], *, samples: int, max_new_tokens: int, temperature: float,
                   top_p: float, batch_size: int, seed: int) -> list[list[tuple[str, str]]]:
    """[(text, finish_reason)] * samples for every prompt, in prompt order; batch b samples with seed + b."""
    from tqdm import tqdm

    results: list[list[tuple[str, str]]] = []
    for batch, start in enumerate(tqdm(range(0, len(prompt_ids), batch_size), desc="teacher", file=sys.stderr,
                                       disable=None)):
        chunk = prompt_ids[start:start + batch_size]
        completions = engine.generate(chunk, n=samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, top_k=0, stop=[], seed=seed + batch)
        for index in range(len(chunk)):
            group = completions[index * samples:(index + 1) * samples]
            results.append([(completion.text, completion.finish_reason) for completion in group])
    return results


def distill_rows(engine, tokenizer, rows: list[dict], *, samples: int, max_reasoning_tokens: int,
                 per_example: int, max_new_tokens: int, temperature: float, top_p: float, batch_size: int,
                 seed: int, teacher: str) -> tuple[list[dict], DistillReport]:
    """(SFT rows, report) for verifier rows: the teacher samples each row's prompt, data.distill judges."""
    from models import render_prompt

    prompt_ids = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    sampled = sample_teacher(engine, prompt_ids, samples=samples, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, batch_size=batch_size, seed=seed)
    report = DistillReport(samples_per_example=samples)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    kept = []
    for row, row_samples in zip(rows, sampled):
        kept += distill_example(row, row_samples, report, per_example=per_example,
                                max_reasoning_tokens=max_reasoning_tokens, count_tokens=count_tokens, teacher=teacher)
    return kept, report


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{name} must be at least 1, got {value}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="model directory, run directory, 'default', or org/name")
    parser.add_argument("--input", required=True, help="judgments JSONL (the format data.verifier reads)")
    parser.add_argument("--out", required=True, help="SFT rows (.jsonl or .parquet); the report goes beside it")
    parser.add_argument("--samples", type=int, default=4, help="teacher samples per example (K)")
    parser.add_argument("--max-reasoning-tokens", type=int, default=256,
                        help="longer reasoning (after a thinking teacher's </think>) is dropped as overlong")
    parser.add_argument("--per-example", type=int, default=1, help="kept samples per example at most")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="teacher's limit; a cut-off sample is dropped")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use the first N input rows")
    parser.add_argument("--no-rebalance", action="store_true",
                        help="keep the input's label ratio (default: 1:1 correct/incorrect, as data.verifier)")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default 8; vllm: all)")
    add_engine_arguments(parser)
    return parser.parse_args(argv)


@exit_2_on_bad_input
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    for name in ("samples", "max_reasoning_tokens", "per_example", "max_new_tokens", "limit", "batch_size"):
        _positive(name.replace("_", "-"), getattr(args, name))
    rows = convert_verifier(args.input)[:args.limit]  # every line is checked (file:line errors) before any model
    if not args.no_rebalance:
        rows = rebalance(rows, args.seed)
    model_dir = resolve_model(args.teacher)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    engine, tokenizer = load_engine(args.engine, model_dir, device, dtype, max_model_len=args.max_model_len)
    batch_size = args.batch_size or (len(rows) if args.engine == "vllm" else 8)
    kept, report = distill_rows(engine, tokenizer, rows, samples=args.samples,
                                max_reasoning_tokens=args.max_reasoning_tokens, per_example=args.per_example,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                batch_size=batch_size, seed=args.seed, teacher=args.teacher)
    print(report.format())
    if not kept:
        print(f"error: no teacher sample passed the filters; {args.out} not written (report: "
              f"{write_report(args.out, report)})", file=sys.stderr)
        return 1
    report_file = write_distilled(kept, args.out, report)
    print(f"{args.out}: {len(kept)} SFT rows; report {report_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
