"""SciFact evidence reward and evidence_qa: every branch of the gate, label aliases, the worked example."""
import json

import pytest

from rewards import compute_score
from rewards.scifact import (
    evidence_items,
    evidence_qa_reward,
    gated_score,
    normalize_label,
    scifact_evidence_reward,
)

GOLD_SENTENCE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"  # 12 tokens


def completion(label: str | None, items: list[str] | None) -> str:
    parts = []
    if label is not None:
        parts.append(f"<answer>\n{label}\n</answer>")
    if items is not None:
        lines = "".join(f"[{number}] {item}\n" for number, item in enumerate(items, start=1))
        parts.append(f"<evidence>\n{lines}</evidence>")
    return "\n\n".join(parts)


def gold(label: str, evidence: list[str] | None = None) -> str:
    return json.dumps({"answer": label, "evidence": evidence if evidence is not None else [GOLD_SENTENCE]})


def score(text: str, ground_truth: str) -> dict:
    return compute_score("scifact_evidence", text, ground_truth)


def test_worked_example():
    # 2 * 5 shared tokens / (5 + 8) = 0.7692; 0.35 * 1 + 0.55 * 0.7692 + 0.10 * 1 = 0.8731
    gold_text = '{"answer": "SUPPORTS", "evidence": ["Vitamin D lowers fracture risk in older adults."]}'
    text = "<answer>\nSUPPORTS\n</answer>\n\n<evidence>\n[1] Vitamin D lowers fracture risk.\n</evidence>"
    result = scifact_evidence_reward("scifact_evidence", text, gold_text)
    assert (round(result["evidence"], 4), round(result["score"], 4)) == (0.7692, 0.8731)


def test_worked_example_is_capped():
    # 0.35*1 + 0.55*0.08 + 0.10*1 = 0.494, capped to 0.25 because evidence 0.08 < 0.2.
    assert gated_score(1.0, "SUPPORTS", "SUPPORTS", 1.0, 0.08, 1.0, ["x"]) == 0.25
    assert 0.35 * 1 + 0.55 * 0.08 + 0.10 * 1 == pytest.approx(0.494, abs=1e-12)
    # End to end: one predicted item of 13 tokens sharing 1 token with the 12-token gold item:
    # F1 = 2*1 / (13 + 12) = 0.08.
    item = "alpha " + " ".join(f"w{index}" for index in range(12))
    result = score(completion("SUPPORTS", [item]), gold("SUPPORTS"))
    assert result["evidence"] == pytest.approx(0.08, abs=1e-12)
    assert (result["answer"], result["conciseness"], result["format"]) == (1.0, 1.0, 1.0)
    assert result["score"] == 0.25


@pytest.mark.parametrize("alias, canonical", [
    ("SUPPORT", "SUPPORTS"), ("SUPPORTS", "SUPPORTS"), ("SUPPORTED", "SUPPORTS"), ("supported", "SUPPORTS"),
    ("REFUTE", "REFUTES"), ("REFUTES", "REFUTES"), ("REFUTED", "REFUTES"), ("CONTRADICT", "REFUTES"),
    ("CONTRADICTS", "REFUTES"), ("contradict", "REFUTES"),
    ("NOT_ENOUGH_INFO", "NOT_ENOUGH_INFO"), ("NEI", "NOT_ENOUGH_INFO"), ("not enough info", "NOT_ENOUGH_INFO"),
    ("Not-Enough-Info", "NOT_ENOUGH_INFO"), ("  nei. ", "NOT_ENOUGH_INFO"),
])
def test_label_aliases(alias, canonical):
    assert normalize_label(alias) == canonical
    # the alias works on both sides: as the prediction and as the gold label
    items = [] if canonical == "NOT_ENOUGH_INFO" else [GOLD_SENTENCE]
    assert score(completion(alias, items), gold(canonical))["answer"] == 1.0
    assert score(completion(canonical, items), gold(alias))["answer"] == 1.0


@pytest.mark.parametrize("text, expected_format", [
    (completion("SUPPORTS", None), 0.5),
    (completion(None, [GOLD_SENTENCE]), 0.5),
    ("SUPPORTS " + GOLD_SENTENCE, 0.0),
    ("<answer>SUPPORTS", 0.0),  # unclosed
])
def test_format_below_one_scores_zero(text, expected_format):
    result = score(text, gold("SUPPORTS"))
    assert result["format"] == expected_format
    assert result["score"] == 0.0


@pytest.mark.parametrize("label, items, expected", [
    ("NOT_ENOUGH_INFO", [], 1.0),                                   # 0.8*1 + 0.2*1
    ("NOT_ENOUGH_INFO", ["short one", "short two"], 0.9),           # 0.8*1 + 0.2*0.5
    ("NOT_ENOUGH_INFO", ["a", "b", "c"], 0.8),                      # 3 items: nei_evidence 0
    ("NOT_ENOUGH_INFO", [" ".join(["word"] * 21)], 0.8),            # 21 words: nei_evidence 0
    ("NOT_ENOUGH_INFO", [" ".join(["word"] * 20)], 0.9),            # exactly 20 words is still short
    ("SUPPORTS", [], 0.2),                                          # 0.8*0 + 0.2*1
    ("REFUTES", ["short one", "short two"], 0.1),                   # 0.8*0 + 0.2*0.5
])
def test_gold_not_enough_info_branch(label, items, expected):
    result = score(completion(label, items), gold("NOT_ENOUGH_INFO", []))
    assert result["score"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("gold_label", ["SUPPORTS", "REFUTES"])
def test_hedging_on_a_decidable_claim_scores_005(gold_label):
    assert score(completion("NOT_ENOUGH_INFO", []), gold(gold_label))["score"] == 0.05
    assert score(completion("NEI", [GOLD_SENTENCE]), gold(gold_label))["score"] == 0.05


def test_weighted_branch_values():
    # exact evidence, right label, 1 item: 0.35 + 0.55 + 0.10
    assert score(completion("REFUTES", [GOLD_SENTENCE]), gold("REFUTES"))["score"] == pytest.approx(1.0, abs=1e-12)
    # wrong label, exact evidence: 0.55 + 0.10 (evidence >= 0.2: no cap)
    assert score(completion("SUPPORTS", [GOLD_SENTENCE]), gold("REFUTES"))["score"] == pytest.approx(0.65, abs=1e-12)
    # 6 exact items: conciseness 0 -> 0.35 + 0.55
    result = score(completion("SUPPORTS", [GOLD_SENTENCE] * 6), gold("SUPPORTS"))
    assert (result["conciseness"], result["score"]) == (0.0, pytest.approx(0.9, abs=1e-12))
    # evidence exactly 0.2 is not capped: 1 shared token of 8 predicted and 2 gold, F1 = 2*1/(8+2) = 0.2
    result = score(completion("SUPPORTS", ["alpha " + " ".join(f"w{i}" for i in range(7))]), gold("SUPPORTS", ["alpha beta"]))
    assert result["evidence"] == pytest.approx(0.2, abs=1e-12)
    assert result["score"] == pytest.approx(0.35 + 0.55 * 0.2 + 0.1, abs=1e-12)
    # no evidence lines at all with a decidable gold: evidence 0, conciseness 0, capped branch
    assert score(completion("SUPPORTS", []), gold("SUPPORTS"))["score"] == pytest.approx(0.25, abs=1e-12)


def test_evidence_is_mean_of_best_match_per_item():
    # item 1 matches gold 2 exactly (1.0), item 2 matches nothing (0.0): mean 0.5
    ground_truth = gold("SUPPORTS", ["unrelated words here", "vitamin d lowers risk"])
    result = score(completion("SUPPORTS", ["Vitamin D lowers risk.", "zzz"]), ground_truth)
    assert result["evidence"] == 0.5
    assert result["score"] == pytest.approx(0.35 + 0.55 * 0.5 + 0.1, abs=1e-12)


@pytest.mark.parametrize("block, items", [
    ("\n[1] First.\n[2] Second.\n", ["First.", "Second."]),
    ("\n- dash item\n* star item\n[3] - numbered dash\n", ["dash item", "star item", "numbered dash"]),
    ("\n\n   \n", []),
    ("[1]\n[2]", ["[1]\n[2]"]),  # every line empties: the whole block is one item
    ("single line without number", ["single line without number"]),
    ("-not a bullet", ["-not a bullet"]),
])
def test_evidence_items(block, items):
    assert evidence_items(block) == items


@pytest.mark.parametrize("ground_truth", [
    {"label": "SUPPORTS", "evidences": [GOLD_SENTENCE]},
    json.dumps({"target": "SUPPORT", "gold_evidence": [GOLD_SENTENCE]}),
    json.dumps({"answer": "SUPPORTS", "evidence": GOLD_SENTENCE}),
])
def test_ground_truth_key_aliases(ground_truth):
    assert score(completion("SUPPORTS", [GOLD_SENTENCE]), ground_truth)["score"] == pytest.approx(1.0, abs=1e-12)


def test_plain_string_ground_truth_is_the_label_without_evidence():
    result = score(completion("SUPPORTS", [GOLD_SENTENCE]), "SUPPORTS")
    assert (result["answer"], result["evidence"], result["score"]) == (1.0, 0.0, 0.25)


@pytest.mark.parametrize("ground_truth, field", [
    ('{"evidence": []}', "'answer'"),
    ('{"answer": 3}', "'answer'"),
    ('{"answer": "SUPPORTS", "evidence": [1, 2]}', "'evidence'"),
    ('{"answer": "SUPPORTS", "gold_evidence": {"a": 1}}', "'gold_evidence'"),
    ('{"answer": "MAYBE"}', "'answer'"),
    ("MAYBE", "'answer'"),
    (None, "'ground_truth'"),
    ('["SUPPORTS"]', "'ground_truth'"),
])
def test_malformed_ground_truth_names_the_field(ground_truth, field):
    with pytest.raises(ValueError, match=field):
        score(completion("SUPPORTS", []), ground_truth)


def test_evidence_qa_weights():
    ground_truth = json.dumps({"answer": "vitamin d deficiency", "evidence": [GOLD_SENTENCE]})
    # answer F1: 2 shared of 2 predicted / 3 gold -> P=1, R=2/3, F1=0.8; evidence 1; format 1; conciseness 1
    result = evidence_qa_reward("evidence_qa", completion("Vitamin D", [GOLD_SENTENCE]), ground_truth)
    assert result["answer_f1"] == pytest.approx(0.8, abs=1e-12)
    assert result["score"] == pytest.approx(0.45 * 0.8 + 0.35 + 0.15 + 0.05, abs=1e-12)
    # answer block only: F1 1, format 0.5, no items
    result = compute_score("evidence_qa", "<answer>vitamin D deficiency</answer>", ground_truth)
    assert result["score"] == pytest.approx(0.45 + 0.15 * 0.5, abs=1e-12)
    assert compute_score("evidence_qa", "", ground_truth)["score"] == 0.0
