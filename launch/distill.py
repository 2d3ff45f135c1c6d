"""Distil a short chain-of-thought verifier SFT set from a teacher model by rejection sampling.

    python -m launch.distill --teacher Qwen/Qwen3-8B --input judgments.jsonl --out data_out/verifier/sft.jsonl \\
        --samples 4 --max-reasoning-tokens 256 --engine vllm                     # GPUs
    python -m launch.distill --teacher default --input data/fixtures/verifier_sample.jsonl --out /tmp/sft.jsonl \\
        --samples 2 --max-new-tokens 64                                          # CPU, the embedded model

Each verifier prompt goes to the teacher --samples times; the samples that pass the filters below become SFT rows
for launch/configs/verifier_sft.yaml (then verifier_dapo.yaml). A sample's reason (REASONS, counted in
OUT.report.json) is the first filter it fails, in this order; only "kept" samples become rows:

    truncated            the teacher hit its token limit (finish reason "length")
    unfinished_thinking  a thinking teacher opened <think> and never closed it
    no_judgment          nothing parses as a judgment (rewards.verifier.parse_judgment, the reward's own parser)
    label_outside_set    a final \\boxed{...} holds something other than A, B or C
    wrong_judgment       the judgment is not the gold letter (rejection sampling: B and C are distinct here)
    unstructured         not "reasoning, then one `Final Judgment: \\boxed{X}` line at the end": several boxes
                         or markers, text after the box, or a judgment given only as a bare letter or tag
    empty_reasoning      nothing before the judgment line
    overlong             the reasoning has more than max_reasoning_tokens tokens
    duplicate            the same reasoning as a sample already kept for this row
    surplus              the row already has per_example kept samples

A thinking teacher is judged on its summary after the last `</think>`: the verifier paper drops the thinking,
which adds length but no accuracy. The SFT target is the reasoning, a blank line and data.verifier's target
line, in a copy of data.verifier's row, so SFT and the verifier reward read one format."""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from data.jsonio import atomic_write_text, exit_on_bad_input
from data.rows import write_rows
from data.verifier import convert_verifier, rebalance, verifier_target
from launch.eval import add_engine_arguments, check_positive, engine_from_args, resolve_model
from models import render_prompt
from rewards.verifier import FINAL_JUDGMENT, JUDGMENTS, last_boxed_span, last_match, parse_judgment

REASONS = ("kept", "truncated", "unfinished_thinking", "no_judgment", "label_outside_set", "wrong_judgment",
           "unstructured", "empty_reasoning", "overlong", "duplicate", "surplus")
# Between "Final Judgment" and its box only a colon, spaces, markdown emphasis or a LaTeX `$` may stand; after
# the box's closing brace only closing punctuation.
_MARKER_TO_BOX = re.compile(r"[\s:：*_`$]*")
_AFTER_BOX = re.compile(r"[\s.。!*_`$)\]]*")
_REASONING_TRAIL = " \t\r\n*_#-:"


def split_reasoning(summary: str) -> str | None:
    """The (maybe empty) reasoning before a well-formed last `Final Judgment: \\boxed{X}` line, else None."""
    span = last_boxed_span(summary)
    marker = last_match(FINAL_JUDGMENT, summary)
    if span is None or marker is None or summary.count("\\boxed{") != 1:
        return None
    box_start = span[0] - len("\\boxed{")
    if marker.end() > box_start or _MARKER_TO_BOX.fullmatch(summary, marker.end(), box_start) is None:
        return None
    if _AFTER_BOX.fullmatch(summary, span[1] + 1) is None:
        return None
    if last_match(FINAL_JUDGMENT, summary[:marker.start()]) is not None:  # the judgment was stated twice
        return None
    return summary[:marker.start()].rstrip(_REASONING_TRAIL).strip()


@dataclass(frozen=True)
class Verdict:
    """One teacher sample's reason (one of REASONS) and, when kept, its reasoning and judgment."""

    reason: str
    reasoning: str | None = None
    judgment: str | None = None


def judge_sample(text: str, gold: str, *, finish_reason: str, max_reasoning_tokens: int,
                 count_tokens: Callable[[str], int]) -> Verdict:
    """One sample through the module docstring's filters (gold: "A", "B" or "C"; count_tokens: teacher tokens)."""
    if gold not in JUDGMENTS:
        raise ValueError(f"gold judgment must be one of {JUDGMENTS}, got {gold!r}")
    if finish_reason == "length":
        return Verdict("truncated")
    *thinking, summary = re.split("</think>", text, flags=re.IGNORECASE)
    if not thinking and "<think>" in text.lower():  # the summary after the thinking was never written
        return Verdict("unfinished_thinking")
    judged = parse_judgment(summary)
    if judged is None:
        return Verdict("label_outside_set" if last_boxed_span(summary) is not None else "no_judgment")
    if judged != gold:
        return Verdict("wrong_judgment", judgment=judged)
    reasoning = split_reasoning(summary)
    if reasoning is None:
        return Verdict("unstructured", judgment=judged)
    if not reasoning:
        return Verdict("empty_reasoning", judgment=judged)
    return Verdict("overlong" if count_tokens(reasoning) > max_reasoning_tokens else "kept", reasoning, judged)


@dataclass
class DistillReport:
    """Counts per reason over every sample and kept rows per gold label (distill_example counts each)."""

    samples_per_example: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    kept_by_label: dict[str, int] = field(default_factory=lambda: dict.fromkeys(JUDGMENTS, 0))
    examples: int = 0
    examples_with_kept: int = 0

    def as_dict(self) -> dict:
        total = sum(self.counts.values())
        return {"examples": self.examples, "samples_per_example": self.samples_per_example, "samples": total,
                "kept": self.counts["kept"], "examples_with_kept": self.examples_with_kept,
                "by_reason": dict(self.counts), "kept_by_label": dict(self.kept_by_label)}

    def format(self) -> str:
        total = max(sum(self.counts.values()), 1)
        lines = [f"{self.examples} examples x {self.samples_per_example} samples: {self.counts['kept']} kept "
                 f"({self.examples_with_kept} examples with at least one); kept by gold label {self.kept_by_label}"]
        lines += [f"  {reason:<20} {count:>7}  {count / total:6.1%}" for reason, count in self.counts.items()]
        return "\n".join(lines)


def distill_example(row: dict, samples: Sequence[tuple[str, str]], report: DistillReport, *, per_example: int,
                    max_reasoning_tokens: int, count_tokens: Callable[[str], int], teacher: str) -> list[dict]:
    """SFT rows from one data.verifier row and its samples [(text, finish_reason)], each counted in `report`."""
    gold = row["reward_model"]["ground_truth"]
    kept: list[dict] = []
    seen: set[str] = set()
    for sample_index, (text, finish_reason) in enumerate(samples):
        verdict = judge_sample(text, gold, finish_reason=finish_reason, max_reasoning_tokens=max_reasoning_tokens,
                               count_tokens=count_tokens)
        reason = verdict.reason
        if reason == "kept" and verdict.reasoning in seen:
            reason = "duplicate"
        elif reason == "kept" and len(kept) >= per_example:
            reason = "surplus"
        report.counts[reason] += 1
        if reason != "kept":
            continue
        seen.add(verdict.reasoning)
        report.kept_by_label[gold] += 1
        distilled = copy.deepcopy(row)
        distilled["extra_info"].update(target=f"{verdict.reasoning}\n\n{verifier_target(verdict.judgment)}",
                                       teacher=teacher, teacher_sample=sample_index)
        kept.append(distilled)
    report.examples += 1
    report.examples_with_kept += bool(kept)
    return kept


def write_distilled(rows: list[dict], out: str | Path, report: DistillReport) -> Path:
    """Write the report beside `out` (sft.jsonl -> sft.report.json), then the rows (none: ValueError); its path."""
    path = Path(out).with_suffix(".report.json")
    atomic_write_text(path, json.dumps(report.as_dict(), indent=1) + "\n")
    if not rows:
        raise ValueError(f"no teacher sample passed the filters, so {out} was not written (report: {path}):\n"
                         f"{report.format()}")
    for index, row in enumerate(rows):  # the SFT rows are numbered afresh; the verifier row's index stays
        row["extra_info"]["source_index"] = row["extra_info"]["index"]
        row["extra_info"]["index"] = index
    write_rows(rows, Path(out))
    return path


def distill_rows(engine, tokenizer, rows: list[dict], *, samples: int, max_reasoning_tokens: int,
                 per_example: int, max_new_tokens: int, temperature: float, top_p: float, batch_size: int,
                 seed: int, teacher: str) -> tuple[list[dict], DistillReport]:
    """(SFT rows, report): each prompt sampled `samples` times (batch b with seed + b), judged by distill_example."""
    report, kept = DistillReport(samples_per_example=samples), []

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    starts = range(0, len(rows), batch_size)
    for batch, start in enumerate(tqdm(starts, desc="teacher", file=sys.stderr, disable=None)):
        chunk = rows[start:start + batch_size]
        completions = engine.generate([render_prompt(tokenizer, row["prompt"]) for row in chunk], n=samples,
                                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=0,
                                      stop=[], seed=seed + batch)
        for index, row in enumerate(chunk):
            group = [(completion.text, completion.finish_reason)
                     for completion in completions[index * samples:(index + 1) * samples]]
            kept += distill_example(row, group, report, per_example=per_example,
                                    max_reasoning_tokens=max_reasoning_tokens, count_tokens=count_tokens,
                                    teacher=teacher)
    return kept, report


@exit_on_bad_input(2)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="model directory, run directory, 'default', or org/name")
    parser.add_argument("--input", required=True, help="judgments JSONL (the format data.verifier reads)")
    parser.add_argument("--out", required=True, help="SFT rows (.jsonl or .parquet); the report goes beside it")
    parser.add_argument("--samples", type=int, default=4, help="teacher samples per example (K)")
    parser.add_argument("--max-reasoning-tokens", type=int, default=256, help="longer reasoning is dropped as overlong")
    parser.add_argument("--per-example", type=int, default=1, help="kept samples per example at most")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="teacher's limit; a cut-off sample is dropped")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use the first N input rows")
    parser.add_argument("--no-rebalance", action="store_true", help="keep the label ratio (default: rebalanced 1:1)")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default 8; vllm: all)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_positive(args, "samples", "max_reasoning_tokens", "per_example", "max_new_tokens", "limit", "batch_size")
    rows = convert_verifier(args.input)[:args.limit]  # every line is checked (file:line errors) before any model
    if not args.no_rebalance:
        rows = rebalance(rows, args.seed)
    engine, tokenizer, _ = engine_from_args(args, resolve_model(args.teacher))
    batch_size = args.batch_size or (len(rows) if args.engine == "vllm" else 8)
    kept, report = distill_rows(engine, tokenizer, rows, samples=args.samples,
                                max_reasoning_tokens=args.max_reasoning_tokens, per_example=args.per_example,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                batch_size=batch_size, seed=args.seed, teacher=args.teacher)
    try:
        report_file = write_distilled(kept, args.out, report)
    except ValueError as error:  # no sample kept: the report is written, the rows are not
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{report.format()}\n{args.out}: {len(kept)} SFT rows; report {report_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
