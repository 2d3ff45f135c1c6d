"""The claim/evidence task shared by SciFact and the generated task: one prompt, one target, one ground truth.

The model sees a claim and numbered sentences and answers
`<answer>\\nLABEL\\n</answer>\\n\\n<evidence>\\n[1] sentence\\n...\\n</evidence>`, which the
`scifact_evidence` reward (rewards/) parses; the ground truth is `{"answer": LABEL, "evidence": [sentences]}`.
"""
from __future__ import annotations

import json

from data.rows import make_row

LABELS = ("SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO")
DATA_SOURCE = "scifact_evidence"
ABILITY = "fact_verification"

# Kept short on purpose: the embedded 135M model must learn the format on a CPU within minutes, and every
# instruction token is paid for in every SFT and RL step. It still states the exact output format.
INSTRUCTIONS = (
    "Does the text support or refute the claim? Answer SUPPORTS, REFUTES or NOT_ENOUGH_INFO and copy "
    "the evidence sentences, in exactly this format:\n"
    "<answer>\n"
    "LABEL\n"
    "</answer>\n"
    "\n"
    "<evidence>\n"
    "[1] evidence sentence\n"
    "</evidence>\n"
    "For NOT_ENOUGH_INFO leave the evidence empty."
)


def _one_line(text: str) -> str:
    """Collapse whitespace so a sentence stays on one numbered line (the reward splits evidence by line)."""
    return " ".join(text.split())


def evidence_prompt(claim: str, title: str, sentences: list[str]) -> str:
    """The user message: the claim, the title, every sentence as `[i] sentence` (0-based), then the instructions.

    >>> print(evidence_prompt("Sky is blue.", "Colours", ["The sky is blue.", "Grass is green."]).split("Does")[0])
    Claim: Sky is blue.
    <BLANKLINE>
    Title: Colours
    [0] The sky is blue.
    [1] Grass is green.
    <BLANKLINE>
    <BLANKLINE>
    """
    numbered = "\n".join(f"[{i}] {_one_line(sentence)}" for i, sentence in enumerate(sentences))
    return f"Claim: {_one_line(claim)}\n\nTitle: {_one_line(title)}\n{numbered}\n\n{INSTRUCTIONS}"


def evidence_target(label: str, evidence: list[str]) -> str:
    """The completion to imitate; NOT_ENOUGH_INFO (or no evidence) gives an empty `<evidence>` block.

    >>> evidence_target("SUPPORTS", ["The sky is blue."])
    '<answer>\\nSUPPORTS\\n</answer>\\n\\n<evidence>\\n[1] The sky is blue.\\n</evidence>'
    >>> evidence_target("NOT_ENOUGH_INFO", [])
    '<answer>\\nNOT_ENOUGH_INFO\\n</answer>\\n\\n<evidence>\\n</evidence>'
    """
    _check_label(label)
    lines = "".join(f"[{k}] {_one_line(sentence)}\n" for k, sentence in enumerate(evidence, start=1))
    return f"<answer>\n{label}\n</answer>\n\n<evidence>\n{lines}</evidence>"


def evidence_ground_truth(label: str, evidence: list[str]) -> str:
    """The reward's ground truth as JSON text: `{"answer": label, "evidence": [sentence, ...]}`."""
    _check_label(label)
    return json.dumps({"answer": label, "evidence": [_one_line(sentence) for sentence in evidence]}, ensure_ascii=False)


def _check_label(label: str) -> None:
    if label not in LABELS:
        raise ValueError(f"label {label!r} is not one of {LABELS}")


def evidence_example(
    claim: str, title: str, sentences: list[str], label: str, evidence_indices: list[int]
) -> tuple[str, str, str]:
    """(prompt text, ground truth JSON, SFT target) for one claim; evidence indices are 0-based into `sentences`.

    The evidence is listed in reading order; NOT_ENOUGH_INFO must come with no indices.
    """
    if label == "NOT_ENOUGH_INFO" and evidence_indices:
        raise ValueError(f"NOT_ENOUGH_INFO takes no evidence, got indices {evidence_indices}")
    if label != "NOT_ENOUGH_INFO" and not evidence_indices:
        raise ValueError(f"{label} needs at least one evidence sentence")
    for index in evidence_indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(sentences):
            raise ValueError(f"evidence index {index!r} is out of range for {len(sentences)} sentences")
    evidence = [sentences[index] for index in sorted(set(evidence_indices))]
    return (
        evidence_prompt(claim, title, sentences),
        evidence_ground_truth(label, evidence),
        evidence_target(label, evidence),
    )


def evidence_row(
    claim: str,
    title: str,
    sentences: list[str],
    label: str,
    evidence_indices: list[int],
    *,
    index: int,
    split: str,
    **extra_info,
) -> dict:
    """A complete `scifact_evidence` row; `extra_info` gets the target, the evidence indices and any extras."""
    prompt, ground_truth, target = evidence_example(claim, title, sentences, label, evidence_indices)
    return make_row(
        [{"role": "user", "content": prompt}],
        data_source=DATA_SOURCE,
        ability=ABILITY,
        ground_truth=ground_truth,
        index=index,
        split=split,
        target=target,
        label=label,
        evidence_indices=sorted(set(evidence_indices)),
        **extra_info,
    )
