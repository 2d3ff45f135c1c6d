"""Answer-equivalence verifier reward (`verifier`): 1 when the verifier's parsed judgment agrees with the
gold label (A = correct versus B/C = incorrect or no usable answer), else 0.

The verifier reads a question, a reference answer and a candidate answer (templates/verifier.txt, filled by
verifier_prompt) and ends with `Final Judgment: \\boxed{A}`. The DAPO overlong penalty comes from the trainer."""
from __future__ import annotations

import functools
import re
from collections import deque
from importlib import resources

from rewards.parsing import load_ground_truth

JUDGMENTS = ("A", "B", "C")
LABEL_KEYS = ("label", "judgment", "answer", "target")
# Gold labels in words, e.g. from xVerify-style data; B and C both count as "not correct".
_WORD_LABELS = {"CORRECT": "A", "TRUE": "A", "INCORRECT": "B", "FALSE": "B", "INCOMPLETE": "C"}
FINAL_JUDGMENT = re.compile(r"final\s+judge?ment", re.IGNORECASE)
_BARE_LETTER = re.compile(r"\s*[:：]?\s*[*_`$(\[]*\s*([ABC])(?![A-Za-z0-9])")
_XVERIFY = re.compile(r"\[(correct|incorrect)\]", re.IGNORECASE)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_BOXED_LETTER = re.compile(r"\(?([ABC])\)?(?![A-Za-z0-9])")
_MAX_BOXED_CHARS = 200
_PLACEHOLDER = re.compile(r"\{(question|reference|candidate)\}")


@functools.cache
def verifier_template() -> str:
    """The shipped prompt template (placeholders {question} {reference} {candidate})."""
    return resources.files("rewards").joinpath("templates/verifier.txt").read_text(encoding="utf-8")


def verifier_prompt(question: str, reference: str, candidate: str, template: str | None = None) -> str:
    """The template (default: the shipped one) with the three fields filled in one regex pass: not str.format,
    since templates hold literal braces (`\\boxed{X}`), and a field's own "{reference}" is never substituted."""
    template = verifier_template() if template is None else template
    values = {"question": question, "reference": reference, "candidate": candidate}
    missing = ", ".join(f"{{{name}}}" for name in values if f"{{{name}}}" not in template)
    if missing:
        raise ValueError(f"verifier template lacks the placeholder(s) {missing}")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def last_boxed_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the content of the last `\\boxed{...}` with balanced braces (at most 200 characters),
    text[end] being its closing brace, or None (also launch.distill's cut of a teacher's judgment line)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for position in range(content_start, min(len(text), content_start + _MAX_BOXED_CHARS)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth < 0:  # the brace that closes the box
            return content_start, position
    return None


def last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last match of `pattern` in `text`, or None (FINAL_JUDGMENT: the last "Final Judgment" marker)."""
    return next(iter(deque(pattern.finditer(text), maxlen=1)), None)


def parse_judgment(text: str) -> str | None:
    """"A", "B", "C" or None, tried in order: the last `\\boxed{X}` (`\\text{A}`, `(A)`, `A: ...` accepted);
    else the letter right after the last "Final Judgment:"; else the last xVerify `[Correct]`/`[Incorrect]`.
    A letter alone is no judgment."""
    if (span := last_boxed_span(text)) is not None:
        cleaned = _LATEX_COMMAND.sub("", text[span[0]:span[1]]).replace("{", "").replace("}", "").strip()
        if letter := _BOXED_LETTER.match(cleaned):
            return letter.group(1)
    if (marker := last_match(FINAL_JUDGMENT, text)) and (bare := _BARE_LETTER.match(text, marker.end())):
        return bare.group(1)
    if last_tag := last_match(_XVERIFY, text):
        return "A" if last_tag.group(1).lower() == "correct" else "B"
    return None


def gold_judgment(ground_truth: object) -> str:
    """The gold label as A/B/C from "A"/"B"/"C", "correct"/"incorrect"/"incomplete", true/false, or a JSON
    object with one of the keys label/judgment/answer/target; ValueError naming the field otherwise."""
    value = ground_truth if isinstance(ground_truth, bool) else load_ground_truth(ground_truth)
    field = "ground_truth"
    if isinstance(value, dict):
        field = next((key for key in LABEL_KEYS if key in value), None)
        if field is None:
            raise ValueError(f"field 'label' (or {LABEL_KEYS[1:]}) missing from verifier ground truth {value!r:.200}")
        value = value[field]
    if isinstance(value, bool):
        return "A" if value else "B"
    if isinstance(value, str):
        label = value.strip().strip("[]().").upper()
        label = _WORD_LABELS.get(label, label)
        if label in JUDGMENTS:
            return label
    raise ValueError(f"field '{field}' of the verifier ground truth must be A, B, C, correct, incorrect, "
                     f"incomplete or a boolean; got {value!r:.200}")


def verifier_reward(data_source: str, solution_str: str, ground_truth: object, extra_info: dict | None = None) -> dict:
    """score and correct (module docstring); parsed (a judgment was found); judged_a/b/c (one-hot, 0 if unparsed)."""
    gold = gold_judgment(ground_truth)
    judged = parse_judgment(solution_str)
    correct = 1.0 if judged is not None and (judged == "A") == (gold == "A") else 0.0
    return {"score": correct, "correct": correct, "parsed": 1.0 if judged is not None else 0.0,
            "judged_a": float(judged == "A"), "judged_b": float(judged == "B"), "judged_c": float(judged == "C")}
