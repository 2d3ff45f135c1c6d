"""SciFact's claim/evidence task as `scifact_evidence` rows (data/synthetic.py's generated task uses them too),
and the official release files converted to them: `python -m data.scifact --input DIR --out DIR`.

Per claim of the release: the first evidence document and its first rationale set (SUPPORT -> SUPPORTS,
CONTRADICT -> REFUTES); a claim without evidence gets its first cited document and NOT_ENOUGH_INFO."""
from __future__ import annotations

import argparse
import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from data.jsonio import describe, exit_on_bad_input, iter_jsonl, require
from data.rows import make_row, write_rows
from rewards.scifact import LABELS

DATA_SOURCE = "scifact_evidence"
ABILITY = "fact_verification"
LABEL_NAMES = {"SUPPORT": "SUPPORTS", "CONTRADICT": "REFUTES"}  # the release's labels
DEFAULT_SPLITS = ("train", "dev")

# Short on purpose: the embedded 135M model must learn the format on a CPU in minutes, and every token here
# is paid for in every SFT and RL step.
INSTRUCTIONS = """Does the text support or refute the claim? Answer SUPPORTS, REFUTES or NOT_ENOUGH_INFO and copy \
the evidence sentences, in exactly this format:
<answer>
LABEL
</answer>

<evidence>
[1] evidence sentence
</evidence>
For NOT_ENOUGH_INFO leave the evidence empty."""


SEARCH_INSTRUCTIONS = ("Search the scientific corpus for evidence: write <tool_call>{\"name\": \"search\", "
                       "\"arguments\": {\"query\": \"...\"}}</tool_call> and read the sentences it returns. "
                       + INSTRUCTIONS.replace("Does the text support", "Then, does what you found support"))


def _one_line(text: str) -> str:
    """Collapse whitespace so a sentence stays on one numbered line (the reward splits evidence by line)."""
    return " ".join(text.split())


def evidence_prompt(claim: str, title: str, sentences: list[str], search: bool = False) -> str:
    """The user message: the claim, the title, the sentences numbered from 0, then INSTRUCTIONS; with `search`, the
    claim and SEARCH_INSTRUCTIONS only."""
    if search:
        return f"Claim: {_one_line(claim)}\n\n{SEARCH_INSTRUCTIONS}"
    numbered = "\n".join(f"[{i}] {_one_line(sentence)}" for i, sentence in enumerate(sentences))
    return f"Claim: {_one_line(claim)}\n\nTitle: {_one_line(title)}\n{numbered}\n\n{INSTRUCTIONS}"


def evidence_row(claim: str, title: str, sentences: list[str], label: str, evidence_indices: list[int], *,
                 index: int, split: str, search: Callable[[str], str] | None = None, **extra_info) -> dict:
    """A row: the prompt, the ground truth `{"answer": label, "evidence": [sentences]}` as JSON text, and in
    `extra_info` the SFT target (the completion to imitate), the label, the evidence indices (0-based into
    `sentences`, listed in reading order) and any extras. With `search` (the search tool), the prompt leaves the
    abstract out and the target is a searcher's trajectory: the claim as the query, the tool's answer, then the
    label with the gold sentences that answer holds (a model can only copy what it has read)."""
    if label not in LABELS:
        raise ValueError(f"label {label!r} is not one of {LABELS}")
    if label == "NOT_ENOUGH_INFO" and evidence_indices:
        raise ValueError(f"NOT_ENOUGH_INFO takes no evidence, got indices {evidence_indices}")
    if label != "NOT_ENOUGH_INFO" and not evidence_indices:
        raise ValueError(f"{label} needs at least one evidence sentence")
    for position in evidence_indices:
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(sentences):
            raise ValueError(f"evidence index {position!r} is out of range for {len(sentences)} sentences")
    indices = sorted(set(evidence_indices))
    evidence = [_one_line(sentences[position]) for position in indices]
    ground_truth = json.dumps({"answer": label, "evidence": evidence}, ensure_ascii=False)
    found = search(_one_line(claim)) if search else ""
    lines = "".join(f"[{k}] {sentence}\n" for k, sentence in enumerate(
        [sentence for sentence in evidence if sentence in found] if search else evidence, start=1))
    target = f"<answer>\n{label}\n</answer>\n\n<evidence>\n{lines}</evidence>"  # NOT_ENOUGH_INFO: an empty block
    if search:
        call = json.dumps({"name": "search", "arguments": {"query": _one_line(claim)}})
        target = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                  {"role": "tool", "content": found}, {"role": "assistant", "content": target}]
    return make_row([{"role": "user", "content": evidence_prompt(claim, title, sentences, search is not None)}],
                    data_source=DATA_SOURCE, ability=ABILITY, ground_truth=ground_truth, index=index, split=split,
                    target=target, label=label, evidence_indices=indices, **extra_info)


def load_corpus(path: str | Path) -> dict[int, dict]:
    """`{doc_id: {"title": str, "abstract": [sentence, ...]}}` from `corpus.jsonl`; duplicate ids are errors."""
    corpus: dict[int, dict] = {}
    for where, record in iter_jsonl(path):
        doc_id = require(record, "doc_id", int, where)
        title = require(record, "title", str, where)
        abstract = require(record, "abstract", list, where)
        if not abstract or not all(isinstance(sentence, str) for sentence in abstract):
            raise ValueError(f"{where}: field 'abstract' of doc_id {doc_id} must be a non-empty list of strings")
        if doc_id in corpus:
            raise ValueError(f"{where}: duplicate doc_id {doc_id} (first seen at {corpus[doc_id]['where']})")
        corpus[doc_id] = {"title": title, "abstract": abstract, "where": where}
    return corpus


def _choose_evidence(record: dict, where: str) -> tuple[int, str, list[int]]:
    """(doc_id, label, sentence indices) of a claim, by the rule in the module docstring."""
    claim_id = record["id"]
    evidence = require(record, "evidence", dict, where)
    if not evidence:
        cited = require(record, "cited_doc_ids", list, where)
        if not cited or isinstance(cited[0], bool) or not isinstance(cited[0], int):
            raise ValueError(f"{where}: claim id {claim_id} has no evidence and no integer 'cited_doc_ids'")
        return cited[0], "NOT_ENOUGH_INFO", []
    doc_key, rationales = next(iter(evidence.items()))
    try:  # the sentence indices are checked against the document by evidence_row
        return int(doc_key), LABEL_NAMES[rationales[0]["label"]], list(rationales[0]["sentences"])
    except (LookupError, TypeError, ValueError):
        raise ValueError(f"{where}: claim id {claim_id}: field 'evidence.{doc_key}' must be a non-empty list of "
                         "rationales {'label': SUPPORT or CONTRADICT, 'sentences': [index, ...]} under a doc_id, "
                         f"got {describe(rationales)}") from None


def convert_claims(claims_path: str | Path, corpus: dict[int, dict], split: str,
                   search: Callable[[str], str] | None = None) -> list[dict]:
    """Rows for every claim of one `claims_<split>.jsonl` (search: for the search tool, as evidence_row); reads the
    whole file before returning anything."""
    claims_path = Path(claims_path)
    records = list(iter_jsonl(claims_path))
    if all("evidence" not in record for _, record in records):
        raise ValueError(f"{claims_path}: these claims have no 'evidence' labels (the official SciFact test split "
                         "hides them), so they cannot be used for training or evaluation; use claims_train.jsonl and "
                         "claims_dev.jsonl")
    rows: list[dict] = []
    first_seen: dict[int, str] = {}
    for where, record in records:
        claim_id = require(record, "id", int, where)
        if claim_id in first_seen:
            raise ValueError(f"{where}: duplicate claim id {claim_id} (first seen at {first_seen[claim_id]})")
        first_seen[claim_id] = where
        claim = require(record, "claim", str, where)
        doc_id, label, indices = _choose_evidence(record, where)
        if doc_id not in corpus:
            raise ValueError(f"{where}: claim id {claim_id} cites doc_id {doc_id}, which is not in the corpus")
        document = corpus[doc_id]
        try:
            rows.append(evidence_row(claim, document["title"], document["abstract"], label, indices, index=len(rows),
                                     split=split, search=search, claim_id=claim_id, doc_id=doc_id))
        except ValueError as error:  # the rationale's sentence indices do not fit the document
            raise ValueError(f"{where}: claim id {claim_id}, doc_id {doc_id}: {error}") from None
    return rows


def convert_directory(input_dir: str | Path, splits: tuple[str, ...] = DEFAULT_SPLITS,
                      search: Callable[[str], str] | None = None) -> dict[str, list[dict]]:
    """`{split: rows}` for `claims_<split>.jsonl` in `input_dir`, all read and checked before any is returned."""
    input_dir = Path(input_dir)
    corpus = load_corpus(input_dir / "corpus.jsonl")
    return {split: convert_claims(input_dir / f"claims_{split}.jsonl", corpus, split, search) for split in splits}


@exit_on_bad_input()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.scifact", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="folder with corpus.jsonl and claims_<split>.jsonl")
    parser.add_argument("--out", required=True, help="folder to write <split>.jsonl (or .parquet) into")
    parser.add_argument("--splits", nargs="+", default=list(DEFAULT_SPLITS), help="default: train dev")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--search", action="store_true", help="rows for the search tool, and its index in "
                        "OUT/search_index (launch/configs/veriseek_search_sft.yaml and veriseek_search.yaml)")
    args = parser.parse_args(argv)
    search = None
    if args.search:  # the index the run searches (rollout.search_index), searched here for the SFT targets
        from rollout import search as tool

        index = Path(args.out) / "search_index"
        print(f"{index}: {tool.build_index(Path(args.input) / 'corpus.jsonl', index)} sentences indexed")
        search = functools.partial(tool.top_sentences, str(index))
    converted = convert_directory(args.input, tuple(args.splits), search)
    for split, rows in converted.items():
        path = Path(args.out) / f"{split}.{args.format}"
        write_rows(rows, path)
        counts = Counter(row["extra_info"]["label"] for row in rows)
        print(f"{path}: {len(rows)} rows {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
