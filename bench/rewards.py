"""Completions per second of each reward on one core, and the co-occurrence reward's query latency on a
corpus index built over the SciFact corpus.

    python -m bench.rewards                       # all rewards; index over the 5,183 SciFact abstracts
    python -m bench.rewards --out bench/results/rewards.json
    python -m bench.rewards --quick               # smoke run: few completions, index over 300 abstracts

Rewards, each called through the trainer's entry point `rewards.compute_score` (registry lookup and result
checks included) unless named otherwise:
  scifact_evidence  generated evidence-task rows (data.synthetic); per row a group of 8 completions: the
                    SFT target, wrong label, empty evidence, no evidence block, free text, target plus
                    rambling, every sentence as evidence, empty.
  verifier          the verifier fixture rows; per row 8 judgments (A/B/C boxed, bare, xVerify-style, none).
  factqa judge      rewards.factqa.judge + format_reward (the factqa_corpus score without the corpus) on
                    NQ-Open questions: right, wrong, refusal, untagged answers.
  factqa_corpus     the whole reward (judge, format, one co-occurrence query per sentence) on the index.
The timed loop runs on the calling thread pinned to one CPU (os.sched_setaffinity; restored afterwards).
Each reward's figure is the median of --repeats passes over its completions; the ground-truth parse cache of
scifact_evidence is warm after the first pass, as in training, where a group's G completions share it.

Co-occurrence latency: head/tail words of the triples that rewards.triples.RuleTripleExtractor finds in the
SciFact claims, counted within 1,000 tokens. "uncached": a counter with cache_positions=0, so every query
goes to infini-gram; "as in training": the default counter, each query asked 8 times in a row (a group).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bench.report import write_results

SHARED_DATA = Path(os.environ.get("NANOGRPO_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GROUP = 8
RAMBLE = " ".join(["The model keeps writing text that is not part of the requested format."] * 6)


@contextmanager
def one_core():
    """Pin the calling thread to one CPU it may use; yields that CPU's number."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, allowed)


def completions_per_second(function, cases: list[tuple], repeats: int) -> dict:
    """Median (and min/max) completions/s of `function(*case)` over `repeats` passes over `cases`."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for case in cases:
            function(*case)
        rates.append(len(cases) / (time.perf_counter() - started))
    return {"completions_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "completions": len(cases), "repeats": repeats}


def evidence_cases(rows: int) -> list[tuple]:
    """(data_source, completion, ground_truth, extra_info) for `rows` generated rows x GROUP completions."""
    from data.synthetic import generate_rows

    cases = []
    for row in generate_rows(rows, seed=0):
        target, truth = row["extra_info"]["target"], row["reward_model"]["ground_truth"]
        sentences = re.findall(r"^\[\d+\] (.*)$", row["prompt"][-1]["content"], flags=re.MULTILINE)
        label = re.search(r"<answer>\n(\w+)\n</answer>", target).group(1)
        wrong = "REFUTES" if label != "REFUTES" else "SUPPORTS"
        every = "\n".join(f"[{i + 1}] {sentence}" for i, sentence in enumerate(sentences))
        texts = [target, target.replace(label, wrong, 1),
                 f"<answer>\n{label}\n</answer>\n\n<evidence>\n</evidence>", f"<answer>\n{label}\n</answer>",
                 f"The claim is probably true. {sentences[0]}", target + "\n\n" + RAMBLE,
                 f"<answer>\n{label}\n</answer>\n\n<evidence>\n{every}\n</evidence>", ""]
        cases += [(row["data_source"], text, truth, row["extra_info"]) for text in texts]
    return cases


def verifier_cases(copies: int) -> list[tuple]:
    from rewards.verifier import gold_judgment

    path = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "verifier_sample.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    reasoning = "The candidate answer states the same quantity as the reference, in other words. "
    judgments = [f"{reasoning}Final Judgment: \\boxed{{A}}", f"{reasoning * 3}Final Judgment: \\boxed{{B}}",
                 "Final Judgment: \\boxed{C}", f"{reasoning}Final Judgment: A", "[Correct]", "[Incorrect]",
                 f"{reasoning}I cannot decide.", f"{reasoning}\\boxed{{\\text{{A}}}}"]
    cases = []
    for copy in range(copies):
        for record in records:
            truth = gold_judgment(record["gold_judgment"])
            cases += [("verifier", text, truth, None) for text in judgments]
    return cases


def factqa_cases(questions: int) -> list[tuple]:
    records = json.loads((SHARED_DATA / "factqa" / "nq_open_validation.json").read_text())[:questions]
    cases = []
    for record in records:
        truth = ";".join(record["aliases"])
        think = f"The question asks: {record['question']}. I recall the relevant facts and check them."
        answers = [record["answer"], f"It is {record['answer']}, I think", "Paris", "I don't know"]
        cases += [(f"<think>{think}</think><answer>{answer}</answer>", truth) for answer in answers]
        cases += [(f"{think} {record['answer']}", truth), (f"<think>ok</think><answer>{record['answer']}</answer>", truth),
                  (f"<think>{think * 4}</think><answer>{record['answer']}</answer>", truth), ("", truth)]
    return cases


def factqa_judge(solution: str, truth: str) -> float:
    from rewards.factqa import format_reward, judge
    return judge(solution, truth) + format_reward(solution)


def build_scifact_index(work_dir: Path, documents: int | None) -> tuple[Path, float]:
    """Index the SciFact abstracts (title + sentences as one text each); returns (index, build seconds)."""
    from rewards.corpus import build_index

    corpus = work_dir / "corpus.jsonl"
    with open(SHARED_DATA / "scifact" / "corpus.jsonl", encoding="utf-8") as source, open(corpus, "w") as out:
        for number, line in enumerate(source):
            if documents is not None and number >= documents:
                break
            record = json.loads(line)
            out.write(json.dumps({"text": record["title"] + "\n" + " ".join(record["abstract"])}) + "\n")
    started = time.perf_counter()
    index = build_index(corpus, work_dir / "index")
    return index, time.perf_counter() - started


def claim_queries(limit: int) -> tuple[list[tuple[list[str], list[str]]], list[str]]:
    """(head words, tail words) of the triples found in the SciFact claims, and the claims that gave them."""
    from rewards.triples import RuleTripleExtractor, query_words

    extractor, queries, claims = RuleTripleExtractor(), [], []
    for name in ("claims_dev.jsonl", "claims_train.jsonl"):
        for line in (SHARED_DATA / "scifact" / name).read_text().splitlines():
            claim = json.loads(line)["claim"]
            triple = extractor.extract(claim)
            words = query_words(triple) if triple is not None else None
            if words is not None:
                queries.append(words)
                claims.append(claim)
            if len(queries) >= limit:
                return queries, claims
    return queries, claims


def query_latency(index_dir: Path, queries: list, *, cached: bool) -> dict:
    from rewards.corpus import CorpusIndex

    counter = CorpusIndex(index_dir) if cached else CorpusIndex(index_dir, cache_positions=0)
    repeats = GROUP if cached else 1
    latencies, hits = [], 0
    for head, tail in queries:
        for _ in range(repeats):
            started = time.perf_counter()
            count = counter.count_cooccurrence(head, tail, 1000)
            latencies.append(time.perf_counter() - started)
        hits += count > 0
    latencies.sort()
    return {"median_ms": 1e3 * statistics.median(latencies), "p90_ms": 1e3 * latencies[int(0.9 * (len(latencies) - 1))],
            "max_ms": 1e3 * latencies[-1], "queries": len(latencies), "nonzero_counts": hits}


def run(quick: bool, repeats: int) -> dict:
    import rewards
    from rewards.corpus import CorpusIndex
    from rewards.factqa import make_factqa_reward

    results: dict = {"rewards": {}, "cooccurrence": {}}
    cases = {"scifact_evidence": evidence_cases(16 if quick else 256),
             "verifier": verifier_cases(1 if quick else 16), "factqa judge": factqa_cases(16 if quick else 256)}
    with tempfile.TemporaryDirectory(prefix="nanogrpo-bench-rewards-") as work:
        index_dir, build_seconds = build_scifact_index(Path(work), 300 if quick else None)
        meta = json.loads((index_dir / "nanogrpo-index.json").read_text())
        results["cooccurrence"]["index"] = {"documents": meta["documents"], "tokens": meta["tokens"],
                                            "build_seconds": build_seconds}
        queries, claims = claim_queries(40 if quick else 1000)
        reward = make_factqa_reward(CorpusIndex(index_dir))
        thinks = [" ".join(claims[i: i + 3]) for i in range(0, len(claims), 3)]
        corpus_cases = [("factqa_corpus", f"<think>{think}</think><answer>yes</answer>", "yes")
                        for think in thinks for _ in range(2)]
        with one_core() as cpu:
            results["cpu"] = cpu
            for name, items in cases.items():
                function = factqa_judge if name == "factqa judge" else rewards.compute_score
                results["rewards"][name] = completions_per_second(function, items, repeats)
            results["rewards"]["factqa_corpus"] = completions_per_second(reward, corpus_cases, 1)
            results["rewards"]["factqa_corpus"]["sentences_per_completion"] = 3
            results["cooccurrence"]["uncached"] = query_latency(index_dir, queries, cached=False)
            results["cooccurrence"]["as_in_training"] = query_latency(index_dir, queries, cached=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: small case lists, index over 300 abstracts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if not (SHARED_DATA / "scifact" / "corpus.jsonl").is_file():
        raise FileNotFoundError(f"SciFact corpus not found under {SHARED_DATA}; set NANOGRPO_SHARED_DATA")
    results = run(args.quick, 2 if args.quick else args.repeats)
    results["load_average"] = os.getloadavg()
    print(f"one core (cpu {results['cpu']}); load average {results['load_average'][0]:.2f}")
    print(f"{'reward':<18} {'completions/s':>14} {'min':>10} {'max':>10} {'completions':>12}")
    for name, row in results["rewards"].items():
        print(f"{name:<18} {row['completions_per_s']:>14,.0f} {row['min']:>10,.0f} {row['max']:>10,.0f} "
              f"{row['completions']:>12}")
    index = results["cooccurrence"]["index"]
    print(f"co-occurrence index: {index['documents']} documents, {index['tokens']:,} tokens, built in "
          f"{index['build_seconds']:.1f} s")
    for mode in ("uncached", "as_in_training"):
        row = results["cooccurrence"][mode]
        print(f"query latency {mode:<15} median {row['median_ms']:.3f} ms, p90 {row['p90_ms']:.3f} ms, "
              f"max {row['max_ms']:.3f} ms over {row['queries']} queries ({row['nonzero_counts']} nonzero)")
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
