"""Evidence-aware claim-verification rewards: `scifact_evidence` (gated, as in the published SciFact recipe)
and `evidence_qa` (a smooth weighted sum for free-text answers with evidence).

Completion protocol: `<answer>\\nLABEL\\n</answer>\\n\\n<evidence>\\n[1] sentence\\n[2] ...\\n</evidence>`, LABEL in
SUPPORTS / REFUTES / NOT_ENOUGH_INFO. Ground truth: JSON `{"answer": label, "evidence": [sentence, ...]}`
(keys `label`/`target` and `evidences`/`gold_evidence` also accepted); a non-JSON string is the answer alone."""
from __future__ import annotations

import functools
import re
from collections import Counter

from rewards.parsing import bag_f1, extract_block, load_ground_truth, normalize_text, token_bag, token_f1

SUPPORTS, REFUTES, NOT_ENOUGH_INFO = "SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO"
LABELS = (SUPPORTS, REFUTES, NOT_ENOUGH_INFO)
LABEL_ALIASES = {"SUPPORT": SUPPORTS, "SUPPORTED": SUPPORTS, "REFUTE": REFUTES, "REFUTED": REFUTES,
                 "CONTRADICT": REFUTES, "CONTRADICTS": REFUTES, "NEI": NOT_ENOUGH_INFO}  # a label maps to itself
ANSWER_KEYS = ("answer", "label", "target")
EVIDENCE_KEYS = ("evidence", "evidences", "gold_evidence")
MAX_CONCISE_ITEMS = 5
NEI_SHORT_ITEMS, NEI_SHORT_WORDS = 2, 20
EVIDENCE_CAP_BELOW, CAPPED_SCORE = 0.2, 0.25
_ITEM_NUMBER = re.compile(r"^\[\d+\]\s*")
_ITEM_BULLET = re.compile(r"^[-*]\s+")


def normalize_label(text: str) -> str:
    """normalize_text, upper-case, spaces to `_`, then LABEL_ALIASES; an unknown label is returned as is."""
    label = normalize_text(text).upper().replace(" ", "_")
    return LABEL_ALIASES.get(label, label)


def gold_label(answer: str) -> str:
    """The ground truth's answer as one of LABELS (after the alias table); ValueError naming the field otherwise."""
    label = normalize_label(answer)
    if label not in LABELS:
        raise ValueError(f"field 'answer' of the ground truth is {answer!r}; expected SUPPORTS, REFUTES or "
                         f"NOT_ENOUGH_INFO (or an alias: {sorted(LABEL_ALIASES)})")
    return label


def evidence_items(block: str | None) -> list[str]:
    """Non-empty lines of an `<evidence>` block without a leading `[n] ` and then `- ` or `* ` (the whole
    stripped block when every line empties; no block, no items)."""
    stripped = (block or "").strip()
    items = []
    for line in stripped.splitlines():
        item = line.strip()
        if item[:1] in ("[", "-", "*"):  # most lines have no marker: skip the two regexes for them
            item = _ITEM_BULLET.sub("", _ITEM_NUMBER.sub("", item)).strip()
        if item:
            items.append(item)
    return items or ([stripped] if stripped else [])


def _parse(ground_truth: object) -> tuple[str, tuple[str, ...], tuple[Counter, ...]]:
    value = load_ground_truth(ground_truth)
    if isinstance(value, str):
        return value, (), ()
    if not isinstance(value, dict):
        raise ValueError(f"field 'ground_truth' must be a JSON object or a plain answer, got {type(value).__name__}")
    answer_key = next((key for key in ANSWER_KEYS if key in value), None)
    if answer_key is None or not isinstance(value[answer_key], str):
        raise ValueError(f"field 'answer' (or 'label'/'target') must be a string in ground truth {value!r:.200}")
    evidence_key = next((key for key in EVIDENCE_KEYS if key in value), None)
    evidence = [] if evidence_key is None or value[evidence_key] is None else value[evidence_key]
    if isinstance(evidence, str):
        evidence = [evidence]
    if not isinstance(evidence, list) or not all(isinstance(item, str) for item in evidence):
        raise ValueError(f"field '{evidence_key}' must be a list of strings in ground truth {value!r:.200}")
    return value[answer_key], tuple(evidence), tuple(bag for bag in map(token_bag, evidence) if bag)


_parse_cached = functools.lru_cache(maxsize=4096)(_parse)


def parse_ground_truth(ground_truth: object) -> tuple[str, tuple[str, ...], tuple[Counter, ...]]:
    """(answer text, gold evidence sentences, their non-empty token bags); ValueError names a bad field. Cached
    for strings: the G completions of a prompt share one ground truth."""
    return _parse_cached(ground_truth) if isinstance(ground_truth, str) else _parse(ground_truth)


def evidence_score(items: list[str], gold: tuple[Counter, ...]) -> float:
    """Mean over predicted items of the best token F1 against any gold item; 0 if either side is empty."""
    if not items or not gold:
        return 0.0
    return sum(max(bag_f1(bag, gold_bag) for gold_bag in gold) for bag in map(token_bag, items)) / len(items)


def completion_parts(solution_str: str) -> tuple[str | None, list[str], float, float]:
    """(answer text or None, evidence items, format, conciseness)."""
    answer = extract_block(solution_str, "answer")
    evidence = extract_block(solution_str, "evidence")
    items = evidence_items(evidence)
    format_score = ((answer is not None) + (evidence is not None)) / 2
    conciseness = 1.0 if 1 <= len(items) <= MAX_CONCISE_ITEMS else 0.0
    return answer, items, format_score, conciseness


def gated_score(format_score: float, gold: str, predicted_label: str, answer: float,
                evidence: float, conciseness: float, items: list[str]) -> float:
    """The published SciFact gate: 0 when format < 1; gold NOT_ENOUGH_INFO -> 0.8*answer + 0.2*(1 for no items,
    0.5 for at most 2 items of at most 20 words, else 0); a NOT_ENOUGH_INFO hedge on a decidable claim -> 0.05;
    otherwise 0.35*answer + 0.55*evidence + 0.10*conciseness, capped at 0.25 when evidence < 0.2."""
    if format_score < 1:
        return 0.0
    if gold == NOT_ENOUGH_INFO:
        short = len(items) <= NEI_SHORT_ITEMS and all(len(normalize_text(item).split()) <= NEI_SHORT_WORDS
                                                      for item in items)
        return 0.8 * answer + 0.2 * (1.0 if not items else 0.5 if short else 0.0)
    if predicted_label == NOT_ENOUGH_INFO:  # a hedge on a decidable claim earns almost nothing
        return 0.05
    score = 0.35 * answer + 0.55 * evidence + 0.10 * conciseness
    if evidence < EVIDENCE_CAP_BELOW:  # a right label without grounded evidence is capped
        score = min(score, CAPPED_SCORE)
    return score


def scifact_evidence_reward(data_source: str, solution_str: str, ground_truth: object,
                            extra_info: dict | None = None) -> dict:
    """gated_score of format (1 both blocks, 0.5 one, 0 none), answer (labels equal after aliasing), evidence
    (evidence_score) and conciseness (1 for 1..5 items); ValueError for a gold label outside LABELS."""
    gold_text, _, gold = parse_ground_truth(ground_truth)
    label = gold_label(gold_text)
    answer_text, items, format_score, conciseness = completion_parts(solution_str)
    predicted_label = normalize_label(answer_text.strip()) if answer_text is not None else ""
    answer = 1.0 if predicted_label == label else 0.0
    evidence = evidence_score(items, gold)
    score = gated_score(format_score, label, predicted_label, answer, evidence, conciseness, items)
    return {"score": score, "format": format_score, "answer": answer, "evidence": evidence, "conciseness": conciseness}


def evidence_qa_reward(data_source: str, solution_str: str, ground_truth: object,
                       extra_info: dict | None = None) -> dict:
    """No gate: 0.45*answer_f1 (token F1) + 0.35*evidence + 0.15*format + 0.05*conciseness."""
    gold_text, _, gold = parse_ground_truth(ground_truth)
    answer_text, items, format_score, conciseness = completion_parts(solution_str)
    answer_f1 = token_f1(answer_text.strip(), gold_text) if answer_text is not None else 0.0
    evidence = evidence_score(items, gold)
    score = 0.45 * answer_f1 + 0.35 * evidence + 0.15 * format_score + 0.05 * conciseness
    return {"score": score, "format": format_score, "answer_f1": answer_f1, "evidence": evidence,
            "conciseness": conciseness}
