"""Answer-verifier data to `verifier` rows: `python -m data.verifier --input FILE --out FILE`.

Input JSONL: `{question, gold_answer, llm_response, gold_judgment}` (optional `domain`), where the judgment is
A (correct / equivalent), B (incorrect) or C (incomplete, repetitive or a refusal), or true/false (A/B).
The prompt is the rewards package's verifier template (or one given) with the question, the gold answer as
`{reference}` and the response as `{candidate}`. The ground truth is the letter; the verifier reward scores
A against B/C. Training sets are rebalanced 1:1 between correct (A) and incorrect (B or C), since a
verifier trained on a skewed set learns the majority label.
"""
from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from data.jsonio import iter_jsonl, require
from data.rows import make_row, write_rows

DATA_SOURCE = "verifier"
ABILITY = "verification"
# The placeholders of rewards/templates/verifier.txt, which the verifier reward's own prompt builder fills.
_PLACEHOLDER = re.compile(r"\{(question|reference|candidate)\}")


def default_template() -> str:
    """The verifier prompt template shipped by the rewards package (rewards/templates/verifier.txt)."""
    from rewards.verifier import verifier_template

    return verifier_template()


def verifier_prompt(template: str, question: str, reference: str, candidate: str) -> str:
    """Fill `{question}`, `{reference}` and `{candidate}` in the template, in one pass.

    A regular expression, not str.format: templates hold literal braces such as `\\boxed{X}`, and one pass
    means a field's text that happens to contain "{reference}" is never substituted again.
    >>> verifier_prompt("Q: {question} Ref: {reference} Said: {candidate} -> \\\\boxed{X}", "{reference}?", "4", "four")
    'Q: {reference}? Ref: 4 Said: four -> \\\\boxed{X}'
    """
    missing = [name for name in ("question", "reference", "candidate") if "{" + name + "}" not in template]
    if missing:
        named = ", ".join("{" + name + "}" for name in missing)
        raise ValueError(f"verifier template lacks the placeholder(s) {named}")
    values = {"question": question, "reference": reference, "candidate": candidate}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def parse_judgment(value, where: str) -> str:
    """A gold judgment (A/B/C, true/false, or "true"/"false") as the letter A, B or C."""
    if isinstance(value, bool):
        return "A" if value else "B"
    if isinstance(value, str):
        text = value.strip().upper()
        if text in ("A", "B", "C"):
            return text
        if text in ("TRUE", "FALSE"):
            return "A" if text == "TRUE" else "B"
    raise ValueError(f"{where}: field 'gold_judgment' is {value!r}; expected A, B, C, true or false")


def verifier_target(judgment: str) -> str:
    """The minimal completion a verifier must end with (the reward reads the last `\\boxed{X}`)."""
    return f"Final Judgment: \\boxed{{{judgment}}}"


def convert_verifier(path: str | Path, template: str | None = None, *, split: str = "train") -> list[dict]:
    """One row per input line; the whole file is checked before anything is returned."""
    path = Path(path)
    template = default_template() if template is None else template
    rows = []
    for line_number, record in iter_jsonl(path):
        where = f"{path}:{line_number}"
        question = require(record, "question", str, where)
        gold_answer = require(record, "gold_answer", str, where)
        llm_response = require(record, "llm_response", str, where)
        if "gold_judgment" not in record:
            raise ValueError(f"{where}: missing field 'gold_judgment'")
        judgment = parse_judgment(record["gold_judgment"], where)
        extra = {"domain": require(record, "domain", str, where)} if "domain" in record else {}
        rows.append(
            make_row(
                [{"role": "user", "content": verifier_prompt(template, question, gold_answer, llm_response)}],
                data_source=DATA_SOURCE,
                ability=ABILITY,
                ground_truth=judgment,
                index=len(rows),
                split=split,
                target=verifier_target(judgment),
                judgment=judgment,
                correct=judgment == "A",
                **extra,
            )
        )
    return rows


def rebalance(rows: list[dict], seed: int = 0) -> list[dict]:
    """Keep all rows of the rarer class (correct = judgment A, incorrect = B or C) and as many of the other,
    sampled under `seed`; the input order is kept. Fails when one class is absent."""
    correct = [i for i, row in enumerate(rows) if row["reward_model"]["ground_truth"] == "A"]
    incorrect = [i for i, row in enumerate(rows) if row["reward_model"]["ground_truth"] != "A"]
    if not correct or not incorrect:
        raise ValueError(f"cannot rebalance: {len(correct)} correct and {len(incorrect)} incorrect rows")
    size = min(len(correct), len(incorrect))
    rng = random.Random(seed)
    chosen = set(rng.sample(correct, size)) | set(rng.sample(incorrect, size))
    return [row for i, row in enumerate(rows) if i in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.verifier", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSONL of {question, gold_answer, llm_response, gold_judgment}")
    parser.add_argument("--out", required=True, help="output .jsonl or .parquet")
    parser.add_argument("--template", default=None, help="template file; default: rewards/templates/verifier.txt")
    parser.add_argument("--split", default="train")
    parser.add_argument("--no-rebalance", action="store_true", help="keep the label ratio (e.g. for evaluation)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        template = Path(args.template).read_text(encoding="utf-8") if args.template else None
        rows = convert_verifier(args.input, template, split=args.split)
        if not args.no_rebalance:
            rows = rebalance(rows, args.seed)
        write_rows(rows, Path(args.out))
    except (ValueError, FileNotFoundError, UnicodeDecodeError) as error:
        raise SystemExit(f"error: {error}") from None
    correct = sum(row["extra_info"]["correct"] for row in rows)
    print(f"{args.out}: {len(rows)} rows ({correct} correct, {len(rows) - correct} incorrect)")


if __name__ == "__main__":
    main()
