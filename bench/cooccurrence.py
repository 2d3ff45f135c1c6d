"""The two co-occurrence window definitions side by side on real queries, and both against infini-gram's own
count_cnf: how often and how far the project's "document" counts differ from the engine's, and how many
sentence rewards (thresholds 1, 5, 20) change.

    python -m bench.cooccurrence                      # 1,000 queries, index over the 5,183 SciFact abstracts
    python -m bench.cooccurrence --out bench/results/cooccurrence.json
    python -m bench.cooccurrence --quick              # smoke run: 40 queries, index over 300 abstracts

Queries: (head words, tail words) of the triples rewards.triples.RuleTripleExtractor finds in the SciFact
claims, then in abstract sentences until --queries are collected (what the factqa_corpus reward asks of an
index: one query per sentence), counted within 1,000 tokens as the reward does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.report import write_results
from bench.rewards import SHARED_DATA, build_scifact_index, claim_queries

WINDOW = 1000


def engine_count(index, head_words: list[str], tail_words: list[str], window: int = 1000) -> int:
    """infini-gram's own `count_cnf` of a CorpusIndex query (each phrase an OR of its variants, the phrases
    ANDed, max_diff_tokens = window in ids): what the "engine" semantics reproduces, for checks."""
    if window < 1:
        raise ValueError(f"the engine's max_diff_tokens must be >= 1, got window {window}")
    cnf = [index.stored(index.tokenizer.variants(phrase)) for phrase in [*head_words, *tail_words]]
    if not all(cnf):
        return 0
    result = index.engine.count_cnf(cnf, max_clause_freq=index.max_clause_freq, max_diff_tokens=window * index.stride)
    if "error" in result:
        raise RuntimeError(f"infini-gram query on {index.path} failed: {result['error']}")
    return int(result["count"])


def sentence_queries(limit: int) -> list[tuple[list[str], list[str]]]:
    """Claim triples first (bench.rewards.claim_queries), then triples of abstract sentences, up to `limit`."""
    from rewards.parsing import split_sentences
    from rewards.triples import RuleTripleExtractor, query_words

    queries, _ = claim_queries(limit)
    extractor = RuleTripleExtractor()
    with open(SHARED_DATA / "scifact" / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            if len(queries) >= limit:
                break
            text = " ".join(json.loads(line)["abstract"])
            for start, end in split_sentences(text):
                triple = extractor.extract(text[start:end])
                words = query_words(triple) if triple is not None else None
                if words is not None:
                    queries.append(words)
    return queries[:limit]


def compare(index_dir: Path, queries: list) -> dict:
    """Per query: the engine definition, infini-gram's own count_cnf and the per-document definition."""
    from rewards.corpus import CorpusIndex
    from rewards.factqa import count_reward

    index = CorpusIndex(index_dir)
    rows = []
    for head, tail in queries:
        rows.append({"head": head, "tail": tail, "engine": index.count_cooccurrence(head, tail, WINDOW),
                     "count_cnf": engine_count(index, head, tail, WINDOW),
                     "document": index.count_cooccurrence(head, tail, WINDOW, semantics="document")})
    differ = [row for row in rows if row["document"] != row["engine"]]
    ratios = [row["document"] / row["engine"] for row in differ if row["engine"]]
    changed = [row for row in rows if count_reward(row["document"]) != count_reward(row["engine"])]
    return {
        "queries": len(rows), "window": WINDOW,
        "engine_equals_count_cnf": sum(row["engine"] == row["count_cnf"] for row in rows),
        "document_differs": len(differ), "document_lower": sum(row["document"] < row["engine"] for row in rows),
        "engine_zero_document_nonzero": sum(row["engine"] == 0 < row["document"] for row in rows),
        "ratio_document_over_engine_median": statistics.median(ratios) if ratios else None,
        "ratio_document_over_engine_max": max(ratios) if ratios else None,
        "sentence_reward_changed": len(changed),
        "reward_transitions": _transitions(changed, count_reward),
        "examples": sorted(differ, key=lambda row: row["engine"] - row["document"])[:5],
    }


def _transitions(rows: list[dict], count_reward) -> dict[str, int]:
    transitions: dict[str, int] = {}
    for row in rows:
        key = f"{count_reward(row['engine']):+.1f} -> {count_reward(row['document']):+.1f}"
        transitions[key] = transitions.get(key, 0) + 1
    return dict(sorted(transitions.items(), key=lambda item: -item[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 queries, index over 300 abstracts")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if not (SHARED_DATA / "scifact" / "corpus.jsonl").is_file():
        raise FileNotFoundError(f"SciFact corpus not found under {SHARED_DATA}; set NANOGRPO_SHARED_DATA")
    with tempfile.TemporaryDirectory(prefix="nanogrpo-bench-cooccurrence-") as work:
        index_dir, _ = build_scifact_index(Path(work), 300 if args.quick else None)
        result = compare(index_dir, sentence_queries(40 if args.quick else args.queries))
    result["load_average"] = os.getloadavg()
    print(f"{result['queries']} queries, window {WINDOW}: engine definition == infini-gram count_cnf in "
          f"{result['engine_equals_count_cnf']}; the per-document count differs in {result['document_differs']} "
          f"(never lower: {result['document_lower'] == 0}; engine 0 but document > 0: "
          f"{result['engine_zero_document_nonzero']}), median ratio document/engine "
          f"{result['ratio_document_over_engine_median']}; sentence reward changed in "
          f"{result['sentence_reward_changed']}: {result['reward_transitions']}")
    if args.out:
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
