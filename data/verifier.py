"""Answer-verifier data to `verifier` rows: `python -m data.verifier --input FILE --out FILE`.

Input JSONL: `{question, gold_answer, llm_response, gold_judgment}` (optional `domain`), the judgment A (correct),
B (incorrect), C (incomplete or a refusal) or true/false, read by the reward's gold_judgment. The prompt is the
verifier template filled with the question, the gold answer and the response; the ground truth is the letter.
Training sets are rebalanced 1:1 between A and B/C: a verifier trained on a skewed set learns the majority."""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from data.jsonio import exit_on_bad_input, iter_jsonl, require
from data.rows import make_row, write_rows
from rewards.verifier import gold_judgment, verifier_prompt

DATA_SOURCE = "verifier"
ABILITY = "verification"


def verifier_target(judgment: str) -> str:
    """The minimal completion a verifier must end with (the reward reads the last `\\boxed{X}`)."""
    return f"Final Judgment: \\boxed{{{judgment}}}"


def convert_verifier(path: str | Path, template: str | None = None, *, split: str = "train") -> list[dict]:
    """One row per input line; the whole file is checked before anything is returned."""
    path = Path(path)
    rows = []
    for where, record in iter_jsonl(path):
        fields = [require(record, key, str, where) for key in ("question", "gold_answer", "llm_response")]
        if "gold_judgment" not in record:
            raise ValueError(f"{where}: missing field 'gold_judgment'")
        try:
            judgment = gold_judgment(record["gold_judgment"])
        except ValueError:
            raise ValueError(f"{where}: field 'gold_judgment' is {record['gold_judgment']!r}; expected A, B, C, "
                             "true or false") from None
        extra = {"domain": require(record, "domain", str, where)} if "domain" in record else {}
        prompt = verifier_prompt(*fields, template)
        rows.append(make_row([{"role": "user", "content": prompt}], data_source=DATA_SOURCE, ability=ABILITY,
                             ground_truth=judgment, index=len(rows), split=split, target=verifier_target(judgment),
                             judgment=judgment, correct=judgment == "A", **extra))
    return rows


def rebalance(rows: list[dict], seed: int = 0) -> list[dict]:
    """All rows of the rarer class (A versus B/C) and as many of the other, sampled under `seed`, in input order."""
    correct = [i for i, row in enumerate(rows) if row["reward_model"]["ground_truth"] == "A"]
    incorrect = [i for i, row in enumerate(rows) if row["reward_model"]["ground_truth"] != "A"]
    if not correct or not incorrect:
        raise ValueError(f"cannot rebalance: {len(correct)} correct and {len(incorrect)} incorrect rows")
    size = min(len(correct), len(incorrect))
    rng = random.Random(seed)
    chosen = set(rng.sample(correct, size)) | set(rng.sample(incorrect, size))
    return [row for i, row in enumerate(rows) if i in chosen]


@exit_on_bad_input()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.verifier", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSONL of {question, gold_answer, llm_response, gold_judgment}")
    parser.add_argument("--out", required=True, help="output .jsonl or .parquet")
    parser.add_argument("--template", default=None, help="template file; default: rewards/templates/verifier.txt")
    parser.add_argument("--split", default="train")
    parser.add_argument("--no-rebalance", action="store_true", help="keep the label ratio (e.g. for evaluation)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    template = Path(args.template).read_text(encoding="utf-8") if args.template else None
    rows = convert_verifier(args.input, template, split=args.split)
    if not args.no_rebalance:
        rows = rebalance(rows, args.seed)
    write_rows(rows, Path(args.out))
    correct = sum(row["extra_info"]["correct"] for row in rows)
    print(f"{args.out}: {len(rows)} rows ({correct} correct, {len(rows) - correct} incorrect)")


if __name__ == "__main__":
    main()
