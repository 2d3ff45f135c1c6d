"""Evaluation metrics (data/metrics.py) on hand-made completions, with the expected numbers derived by hand."""
import json

import pytest

from data.metrics import (factqa_example, factqa_metrics, relaxed_label, scifact_example, scifact_metrics,
                          score_example, summarize, verifier_example, verifier_metrics)


def gold(label, evidence):
    return json.dumps({"answer": label, "evidence": evidence})


def completion(label, items=None):
    text = f"<answer>\n{label}\n</answer>"
    if items is not None:
        text += "\n\n<evidence>\n" + "".join(f"[{k}] {item}\n" for k, item in enumerate(items, start=1)) + "</evidence>"
    return text


A, B, C, D, E, F = (f"Sentence {name} states a fact." for name in "ABCDEF")
SCIFACT_CASES = [
    # 1: right label, one of two gold sentences found plus a wrong one (item text differs only in case/punct.)
    (completion("SUPPORTS", [A.upper().rstrip("."), C]), gold("SUPPORTS", [A, B])),
    # 2: right label, no evidence block at all: format fails, and the decisive answer is unsupported
    (completion("REFUTES"), gold("REFUTES", [D])),
    # 3: right NEI with the empty evidence block
    (completion("NOT_ENOUGH_INFO", []), gold("NOT_ENOUGH_INFO", [])),
    # 4: no blocks; only a relaxed reader finds "supported"
    (f"The claim is supported by: {E}", gold("SUPPORTS", [E])),
    # 5: wrong label, the gold sentence listed twice (matched once)
    (completion("SUPPORTS", [F, F]), gold("REFUTES", [F])),
]


def test_scifact_strict_metrics_by_hand():
    examples = [scifact_example(text, truth) for text, truth in SCIFACT_CASES]
    assert [e["predicted_label"] for e in examples] == ["SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO", None, "SUPPORTS"]
    assert [(e["evidence_matched"], e["evidence_predicted"], e["evidence_gold"]) for e in examples] == [
        (1, 2, 2), (0, 0, 1), (0, 0, 0), (0, 0, 1), (1, 2, 1)]
    metrics = scifact_metrics(examples)
    # correct: cases 1-3 of 5. Evidence summed: matched 2, predicted 4, gold 5 -> P 0.5, R 0.4,
    # F1 = 2*0.5*0.4/0.9 = 4/9. Format: 1, 3, 5. Decisive (SUPPORTS/REFUTES): 1, 2, 5; unsupported: 2 -> 1/3.
    assert metrics == pytest.approx({
        "answer_accuracy": 0.6, "evidence_precision": 0.5, "evidence_recall": 0.4, "evidence_f1": 4 / 9,
        "format_rate": 0.6, "unsupported_rate": 1 / 3, "nei_rate": 0.2, "no_label_rate": 0.2}, abs=1e-12)


def test_scifact_relaxed_reads_the_label_anywhere():
    examples = [scifact_example(text, truth, relaxed=True) for text, truth in SCIFACT_CASES]
    metrics = scifact_metrics(examples)
    # Case 4 now reads SUPPORTS (right, no evidence): 4 of 5 right; decisive 1, 2, 4, 5 with 2 and 4 unsupported.
    assert metrics["answer_accuracy"] == pytest.approx(0.8)
    assert metrics["unsupported_rate"] == pytest.approx(0.5)
    assert metrics["no_label_rate"] == 0.0
    assert metrics["evidence_f1"] == pytest.approx(4 / 9)  # evidence is always the strict parse
    assert metrics["format_rate"] == pytest.approx(0.6)


def test_relaxed_label_takes_the_first_label_word():
    assert relaxed_label("It does not SUPPORT it; the text refutes the claim") == "SUPPORTS"
    assert relaxed_label("There is not enough information here") == "NOT_ENOUGH_INFO"
    assert relaxed_label("contradicts") == "REFUTES"
    assert relaxed_label("supportive unsupported") is None  # whole words only


def test_scifact_strict_rejects_an_unknown_label_in_the_block():
    example = scifact_example(completion("MAYBE", []), gold("SUPPORTS", [A]))
    assert example["predicted_label"] is None and not example["format_ok"] and not example["correct"]
    assert scifact_example(completion("MAYBE", []), gold("SUPPORTS", [A]), relaxed=True)["predicted_label"] is None


def test_scifact_bad_ground_truth_names_the_field():
    with pytest.raises(ValueError, match="'answer'.*MAYBE"):
        scifact_example("x", gold("MAYBE", []))
    with pytest.raises(ValueError, match="'evidence'"):
        scifact_example("x", json.dumps({"answer": "SUPPORTS", "evidence": [1]}))


FACTQA_CASES = [
    "<think>The capital of France is Paris.</think><answer>Paris</answer>",  # correct, format ok
    "<think>I recall it is Lyon for sure.</think><answer>Lyon</answer>",  # attempted, wrong
    "<think>Hmm I am not sure.</think><answer>I don't know</answer>",  # refusal: not attempted
    "Paris is the answer.",  # no tags: not attempted (strict), correct (relaxed)
    "<answer>the city of light</answer>",  # an alias, but no <think>: correct, format fails
]


def test_factqa_metrics_by_hand():
    truth = "Paris;City of Light"
    strict = factqa_metrics([factqa_example(text, truth) for text in FACTQA_CASES])
    # correct 1, 5; attempted 1, 2, 5. P = 2/3, R = 2/5, F1 = 2PR/(P+R) = (8/15)/(16/15) = 0.5.
    assert strict == pytest.approx({"correct_rate": 0.4, "incorrect_rate": 0.2, "not_attempted_rate": 0.4,
                                    "precision": 2 / 3, "recall": 0.4, "f1": 0.5, "format_rate": 0.6}, abs=1e-12)
    relaxed = factqa_metrics([factqa_example(text, truth, relaxed=True) for text in FACTQA_CASES])
    # + case 4: correct 3, attempted 4. P = 3/4, R = 3/5, F1 = 0.9/1.35 = 2/3.
    assert relaxed == pytest.approx({"correct_rate": 0.6, "incorrect_rate": 0.2, "not_attempted_rate": 0.2,
                                     "precision": 0.75, "recall": 0.6, "f1": 2 / 3, "format_rate": 0.6}, abs=1e-12)


def test_factqa_nothing_attempted_gives_zero_not_a_division_error():
    metrics = factqa_metrics([factqa_example("<answer></answer>", "Paris")])
    assert metrics["not_attempted_rate"] == 1.0 and metrics["precision"] == 0.0 and metrics["f1"] == 0.0


def test_verifier_metrics_by_hand():
    examples = [
        verifier_example("Same value. Final Judgment: \\boxed{A}", "A", {"domain": "math"}, 10),  # right
        verifier_example("Final Judgment: B", "C", {"domain": "math"}, 20),  # B vs C: both "not correct"
        verifier_example("\\boxed{A}", "B", {"domain": "code"}, 30),  # wrong
        verifier_example("I cannot decide.", "A", {}, 40),  # nothing parsed: wrong
    ]
    assert verifier_metrics(examples) == {"accuracy": 0.5, "parse_rate": 0.75, "judgment_tokens_mean": 25.0,
                                          "domain_accuracy": {"code": 0.0, "math": 1.0, "none": 0.0}}
    assert "domain_accuracy" not in verifier_metrics([verifier_example("\\boxed{A}", "A")])


def test_summarize_groups_by_source_and_adds_common_metrics():
    records = [
        {"data_source": "scifact_evidence", "completion": completion("NOT_ENOUGH_INFO", []),
         "ground_truth": gold("NOT_ENOUGH_INFO", []), "reward": 1.0, "finish_reason": "stop", "completion_tokens": 12},
        {"data_source": "scifact_evidence", "completion": "junk", "ground_truth": gold("SUPPORTS", [A]),
         "reward": 0.0, "finish_reason": "length", "completion_tokens": 20},
        {"data_source": "my_task", "completion": "x", "ground_truth": "y", "finish_reason": "stop"},
    ]
    summary = summarize([{**record, **score_example(record)} for record in records])
    assert list(summary) == ["scifact_evidence", "my_task"]
    scifact = summary["scifact_evidence"]
    assert scifact["count"] == 2 and scifact["answer_accuracy"] == 0.5 and scifact["nei_rate"] == 0.5
    assert scifact["reward_mean"] == 0.5 and scifact["truncation_rate"] == 0.5
    assert scifact["completion_tokens_mean"] == 16
    assert list(scifact)[:2] == ["count", "answer_accuracy"]  # headline metrics come before the common ones
    assert summary["my_task"] == {"count": 1, "truncation_rate": 0.0}
