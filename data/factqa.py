"""Factual QA sets (NQ-Open, PopQA, SimpleQA, TruthfulQA, the learning-zone curriculum) to `factqa_corpus` rows:
the ground truth is the gold aliases joined with `;`, the system prompt asks for `<think>` then `<answer>`.

    python -m data.factqa convert --input factqa/nq_open_validation.json --out nq.jsonl
    python -m launch.self_filter --input nq.jsonl --out nq_zone.jsonl --group-size 8   # the learning zone"""
from __future__ import annotations

import argparse
from pathlib import Path

from data.jsonio import exit_on_bad_input, iter_jsonl, read_json_array, require
from data.rows import make_row, write_rows

DATA_SOURCE = "factqa_corpus"
ABILITY = "factual_qa"
SYSTEM_PROMPT = ("Answer the question. First think it through inside <think> </think>, stating the facts you rely "
                 "on, then give only the short final answer inside <answer> </answer>.")
# File stems of the factual-QA release files with a shorter data set name (any other file keeps its stem).
DATASET_NAMES = {"nq_open_validation": "nq_open", "popqa_test": "popqa", "stepwise_curriculum_llama31_8b": "curriculum"}


def _aliases(values: list[str]) -> list[str]:
    """Strip, drop empties and duplicates (first kept); `;` inside an alias becomes `,` since `;` separates them."""
    cleaned = (" ".join(value.replace(";", ",").split()) for value in values)
    return list(dict.fromkeys(alias for alias in cleaned if alias))


def factqa_row(question: str, aliases: list[str], *, index: int, split: str, dataset: str, **extra_info) -> dict:
    """One `factqa_corpus` row: system prompt + question; ground truth `alias1;alias2;...`."""
    cleaned = _aliases(aliases)  # convert_factqa has refused a question without one
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": " ".join(question.split())}]
    return make_row(messages, data_source=DATA_SOURCE, ability=ABILITY, ground_truth=";".join(cleaned), index=index,
                    split=split, dataset=dataset, answer=cleaned[0], **extra_info)


def convert_factqa(path: str | Path, *, split: str = "train", start_index: int = 0) -> list[dict]:
    """Rows from a `.json` array or `.jsonl` file of `{question, answer, aliases}` (NQ-Open, PopQA, SimpleQA,
    TruthfulQA: the answer leads the aliases) or `{question, answers, title}` (the learning-zone curriculum,
    `;`-joined; the titles go to `extra_info["titles"]`)."""
    path = Path(path)
    dataset = DATASET_NAMES.get(path.stem, path.stem)
    rows = []
    for where, record in read_json_array(path) if path.suffix == ".json" else list(iter_jsonl(path)):
        question = require(record, "question", str, where)
        if not question.strip():
            raise ValueError(f"{where}: field 'question' is empty")
        extra: dict = {}
        if "aliases" in record:
            answer = require(record, "answer", str, where)
            aliases = require(record, "aliases", list, where)
            if not all(isinstance(alias, str) for alias in aliases):
                raise ValueError(f"{where}: field 'aliases' must be a list of strings")
            aliases = [answer, *aliases]
        elif "answers" in record:
            aliases = require(record, "answers", str, where).split(";")
            titles = require(record, "title", str, where) if "title" in record else ""
            extra["titles"] = [title.strip() for title in titles.split(";") if title.strip()]
        else:
            raise ValueError(f"{where}: missing field 'aliases' (or 'answers' for the curriculum format)")
        if not _aliases(aliases):
            raise ValueError(f"{where}: no non-empty answer alias")
        rows.append(factqa_row(question, aliases, index=start_index + len(rows), split=split, dataset=dataset, **extra))
    return rows


@exit_on_bad_input()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.factqa", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="QA json/jsonl files -> factqa_corpus rows")
    convert.add_argument("--input", nargs="+", required=True, help="one or more .json/.jsonl files")
    convert.add_argument("--out", required=True, help="output .jsonl or .parquet")
    convert.add_argument("--split", default="train")
    convert.add_argument("--limit", type=int, default=None, help="keep the first N rows of each input")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for path in args.input:  # every input is read and checked before anything is written
        rows += convert_factqa(path, split=args.split, start_index=len(rows))[: args.limit]
    write_rows(rows, Path(args.out))
    print(f"{args.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
