"""The claim/evidence task shared by SciFact and the generated task: one prompt, one target, one ground truth.

The model sees a claim and numbered sentences and answers
`<answer>\\nLABEL\\n</answer>\\n\\n<evidence>\\n[1] sentence\\n...\\n</evidence>`, which the
`scifact_evidence` reward (rewards/) parses; the ground truth is `{"answer": LABEL, "evidence": [sentences]}`.
"""
from __future__ import annotations

import json

from data.rows import make_row
from rewards.scifact import LABELS

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
    lines = "".join(f"[{k}] {_one_line(sentence)}\n" for k, sentence in enumerate(evidence, start=1))
    return f"<answer>\n{label}\n</answer>\n\n<evidence>\n{lines}</evidence>"


def evidence_row(claim: str, title: str, sentences: list[str], label: str, evidence_indices: list[int], *,
                 index: int, split: str, **extra_info) -> dict:
    """A complete `scifact_evidence` row: the prompt, the ground truth `{"answer": label, "evidence":
    [sentence, ...]}` as JSON text, and in `extra_info` the SFT target, the label, the evidence indices (0-based
    into `sentences`; the evidence is listed in reading order) and any extras. NOT_ENOUGH_INFO takes no
    evidence, the other labels at least one sentence."""
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
    evidence = [sentences[position] for position in indices]
    ground_truth = json.dumps({"answer": label, "evidence": [_one_line(sentence) for sentence in evidence]},
                              ensure_ascii=False)
    return make_row([{"role": "user", "content": evidence_prompt(claim, title, sentences)}], data_source=DATA_SOURCE,
                    ability=ABILITY, ground_truth=ground_truth, index=index, split=split,
                    target=evidence_target(label, evidence), label=label, evidence_indices=indices, **extra_info)
