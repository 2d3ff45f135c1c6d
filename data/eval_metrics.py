"""Evaluation metrics per data source as pure functions: the published tables' numbers for SciFact evidence,
corpus-grounded factual QA and the answer verifier, read with the rewards' own parsers.

A record: `{"data_source", "completion", "ground_truth"}`, optionally more (score_example, summarize). A rate
over an empty denominator is 0.0 (the official SciFact scorer's safe division), so every metric is a number."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from rewards.factqa import judge_answer, normalize_answer, parse_aliases
from rewards.parsing import extract_block, normalize_text, think_answer_format
from rewards.scifact import (EVIDENCE_CAP_BELOW, LABELS, NOT_ENOUGH_INFO, REFUTES, SUPPORTS, completion_parts,
                             evidence_score, gold_label, normalize_label, parse_ground_truth)
from rewards.verifier import gold_judgment, parse_judgment

SCIFACT, FACTQA, VERIFIER = "scifact_evidence", "factqa_corpus", "verifier"
_PREFIX_LABEL = re.compile(
    r"(?:<answer>)?[\s*_#`\"'>]*(?:(?:final\s+)?(?:answer|label|verdict)[\s*_`]*[:：][\s*_`\"']*)?"
    r"(not[\s_-]+enough[\s_-]+info(?:rmation)?|nei|supports?|supported|refutes?|refuted|contradicts?)(?![\w-])",
    re.IGNORECASE)
_PREFIX_CHARS = 200  # the label must come within the reply's first characters (bounds the regex's work)


def _rate(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def prefix_label(text: str) -> str | None:
    """The label the reply (after the last `</think>`) STARTS with, or None: the diagnostic for models that do not
    write the answer block. Only an `<answer>` tag, markdown and an "Answer:"-like lead-in may precede it, so
    a model echoing the instruction ("Does the text support or refute...") is not credited with SUPPORTS."""
    reply = re.split("</think>", text, flags=re.IGNORECASE)[-1]
    match = _PREFIX_LABEL.match(reply.lstrip()[:_PREFIX_CHARS])
    if match is None:
        return None
    word = match.group(1)
    # "not enough information" is not in the reward's alias table (strict mode rejects it); here it counts.
    return NOT_ENOUGH_INFO if word.lower().startswith("not") else normalize_label(word)


def scifact_example(completion: str, ground_truth: object, *, relaxed: bool = False) -> dict:
    """Per-example SciFact fields. The label is the `<answer>` block's when it is one of LABELS after aliasing,
    else None (relaxed: then prefix_label, recorded in any case); evidence_matched counts exact matches
    (normalize_text equal, each gold sentence once); unsupported: SUPPORTS/REFUTES without grounded evidence."""
    gold_text, gold_evidence, gold_bags = parse_ground_truth(ground_truth)
    gold = gold_label(gold_text)
    answer, items, format_score, _ = completion_parts(completion)
    block_label = normalize_label(answer.strip()) if answer is not None else None
    label = block_label if block_label in LABELS else None
    start_label = prefix_label(completion)
    if relaxed and label is None:
        label = start_label
    evidence_f1 = evidence_score(items, gold_bags)
    matched = sum((Counter(map(normalize_text, items)) & Counter(map(normalize_text, gold_evidence))).values())
    return {"predicted_label": label, "gold_label": gold, "correct": label == gold, "prefix_label": start_label,
            "format_ok": format_score == 1 and block_label in LABELS, "evidence_f1": evidence_f1,
            "evidence_predicted": len(items), "evidence_gold": len(gold_evidence), "evidence_matched": matched,
            "unsupported": label in (SUPPORTS, REFUTES) and evidence_f1 < EVIDENCE_CAP_BELOW}


def scifact_metrics(examples: list[dict]) -> dict:
    """evidence_f1 is the mean over examples with gold evidence; evidence_exact_* sum exact matches over every
    example (evidence offered for an NEI claim lowers precision; a paraphrase scores 0); unsupported_rate is
    over SUPPORTS/REFUTES predictions; format_rate counts both blocks and a valid label."""
    count = len(examples)
    with_gold = [example["evidence_f1"] for example in examples if example["evidence_gold"]]
    matched = sum(example["evidence_matched"] for example in examples)
    precision = _rate(matched, sum(example["evidence_predicted"] for example in examples))
    recall = _rate(matched, sum(example["evidence_gold"] for example in examples))
    decisive = [example for example in examples if example["predicted_label"] in (SUPPORTS, REFUTES)]
    return {"answer_accuracy": _rate(sum(example["correct"] for example in examples), count),
            "evidence_f1": _rate(sum(with_gold), len(with_gold)),
            "evidence_exact_precision": precision, "evidence_exact_recall": recall,
            "evidence_exact_f1": _rate(2 * precision * recall, precision + recall),
            "prefix_label_accuracy": _rate(sum(example["prefix_label"] == example["gold_label"]
                                               for example in examples), count),
            "format_rate": _rate(sum(example["format_ok"] for example in examples), count),
            "unsupported_rate": _rate(sum(example["unsupported"] for example in decisive), len(decisive)),
            "nei_rate": _rate(sum(example["predicted_label"] == NOT_ENOUGH_INFO for example in examples), count),
            "no_label_rate": _rate(sum(example["predicted_label"] is None for example in examples), count)}


def factqa_example(completion: str, ground_truth: object, *, relaxed: bool = False) -> dict:
    """Per-example factual-QA fields: the `<answer>` block (relaxed: else the whole completion, a lenient upper
    bound), attempted (non-empty, not a refusal), correct (the reward's judge) and the reward's format check."""
    aliases = parse_aliases(ground_truth)
    answer = extract_block(completion, "answer")
    if relaxed and answer is None:
        answer = completion
    answer = answer.strip() if answer is not None else None
    # The judge against the answer itself accepts exactly the non-empty non-refusals: one definition of a
    # refusal (the reward's), not a copy of its list.
    attempted = answer is not None and judge_answer(answer, [normalize_answer(answer)]) > 0
    return {"answer": answer, "attempted": attempted, "correct": attempted and judge_answer(answer, aliases) > 0,
            "format_ok": think_answer_format(completion)}


def factqa_metrics(examples: list[dict]) -> dict:
    """correct / incorrect / not_attempted rates (they sum to 1); precision = correct / attempted, recall =
    correct_rate, f1 = 2PR/(P+R) (SimpleQA's F-score); format_rate."""
    count = len(examples)
    correct = sum(example["correct"] for example in examples)
    attempted = sum(example["attempted"] for example in examples)
    precision, recall = _rate(correct, attempted), _rate(correct, count)
    return {"correct_rate": recall, "incorrect_rate": _rate(attempted - correct, count),
            "not_attempted_rate": _rate(count - attempted, count), "precision": precision, "recall": recall,
            "f1": _rate(2 * precision * recall, precision + recall),
            "format_rate": _rate(sum(example["format_ok"] for example in examples), count)}


def verifier_example(completion: str, ground_truth: object, extra_info: dict | None = None,
                     completion_tokens: int | None = None) -> dict:
    """Per-example verifier fields: the reward's (lenient) parse, whether it is on the gold side of A versus B/C,
    extra_info["domain"] (or None) and the judgment's length in tokens."""
    gold = gold_judgment(ground_truth)
    judged = parse_judgment(completion)
    domain = extra_info.get("domain") if isinstance(extra_info, dict) else None
    return {"judgment": judged, "gold_judgment": gold,
            "correct": judged is not None and (judged == "A") == (gold == "A"),
            "domain": domain if isinstance(domain, str) else None, "judgment_tokens": completion_tokens}


def verifier_metrics(examples: list[dict]) -> dict:
    """accuracy, parse_rate, judgment_tokens_mean (over examples with a length) and, when any example has a
    domain, domain_accuracy {domain: accuracy} (the others under "none")."""
    count = len(examples)
    lengths = [example["judgment_tokens"] for example in examples if example["judgment_tokens"] is not None]
    metrics = {"accuracy": _rate(sum(example["correct"] for example in examples), count),
               "parse_rate": _rate(sum(example["judgment"] is not None for example in examples), count),
               "judgment_tokens_mean": _rate(sum(lengths), len(lengths))}
    if any(example["domain"] is not None for example in examples):
        by_domain: dict[str, list[bool]] = {}
        for example in examples:
            by_domain.setdefault(example["domain"] or "none", []).append(example["correct"])
        metrics["domain_accuracy"] = {domain: _rate(sum(values), len(values))
                                      for domain, values in sorted(by_domain.items())}
    return metrics


def score_example(record: dict, *, relaxed: bool = False) -> dict:
    """The per-example fields of one record for its data source ({} for a source with no task metrics)."""
    source, completion, ground_truth = record["data_source"], record["completion"], record["ground_truth"]
    if source == VERIFIER:
        return verifier_example(completion, ground_truth, record.get("extra_info"), record.get("completion_tokens"))
    example = {SCIFACT: scifact_example, FACTQA: factqa_example}.get(source)
    return {} if example is None else example(completion, ground_truth, relaxed=relaxed)


TASK_METRICS = {SCIFACT: scifact_metrics, FACTQA: factqa_metrics, VERIFIER: verifier_metrics}


def summarize(scored: Iterable[dict]) -> dict[str, dict]:
    """{data_source: metrics} over records with score_example's fields, in order of first appearance: count, the
    task metrics, then the means of the fields every record has (reward, finish_reason, completion_tokens)."""
    groups: dict[str, list[dict]] = {}
    for record in scored:
        groups.setdefault(record["data_source"], []).append(record)
    summary = {}
    for source, records in groups.items():
        count = len(records)
        metrics: dict = {"count": count}
        if source in TASK_METRICS:
            metrics.update(TASK_METRICS[source](records))
        for name, key, value in (("reward_mean", "reward", float),
                                 ("truncation_rate", "finish_reason", lambda reason: reason == "length"),
                                 ("completion_tokens_mean", "completion_tokens", int)):
            if all(record.get(key) is not None for record in records):
                metrics[name] = sum(value(record[key]) for record in records) / count
        summary[source] = metrics
    return summary
