"""Evaluation metrics (data/eval_metrics.py) on hand-made completions, with the expected numbers derived by hand."""
import json

import pytest

from data.eval_metrics import (factqa_example, factqa_metrics, prefix_label, scifact_example, scifact_metrics,
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
    # Token F1 (the reward's evidence component): case 1: item 1 equals A (1.0); item 2 "sentence c states a
    # fact" shares 4 of 5 tokens with A or B -> 2*4/10 = 0.8; mean 0.9. Case 5: F twice, 1.0 each -> 1.0.
    # Cases 2 and 4 list nothing -> 0; case 3 has no gold evidence and is left out of the mean.
    assert [e["evidence_f1"] for e in examples] == pytest.approx([0.9, 0.0, 0.0, 0.0, 1.0], abs=1e-12)
    metrics = scifact_metrics(examples)
    # correct: cases 1-3 of 5. evidence_f1 = (0.9 + 0 + 0 + 1.0) / 4 = 0.475. Exact match summed: matched 2,
    # predicted 4, gold 5 -> P 0.5, R 0.4, F1 = 2*0.5*0.4/0.9 = 4/9. Prefix labels: SUPPORTS, REFUTES, NEI, None,
    # SUPPORTS -> right in cases 1-3. Format: 1, 3, 5. Decisive (SUPPORTS/REFUTES): 1, 2, 5; unsupported (token
    # F1 < 0.2): case 2 only -> 1/3 (case 5's label is wrong but its evidence is grounded).
    assert metrics == pytest.approx({
        "answer_accuracy": 0.6, "evidence_f1": 0.475, "evidence_exact_precision": 0.5,
        "evidence_exact_recall": 0.4, "evidence_exact_f1": 4 / 9, "prefix_label_accuracy": 0.6,
        "format_rate": 0.6, "unsupported_rate": 1 / 3, "nei_rate": 0.2, "no_label_rate": 0.2}, abs=1e-12)


def test_paraphrased_evidence_scores_its_token_f1():
    gold_sentence = "Vitamin D lowers the risk of hip fractures in older adults."
    paraphrase = "Vitamin D lowers the risk of hip fractures among older adults."
    example = scifact_example(completion("SUPPORTS", [paraphrase]), gold("SUPPORTS", [gold_sentence]))
    # 11 tokens each, 10 shared ("in" vs "among"): 2*10/22 = 10/11; an exact sentence match finds nothing.
    assert example["evidence_f1"] == pytest.approx(10 / 11, abs=1e-12)
    metrics = scifact_metrics([example])
    assert metrics["evidence_f1"] == pytest.approx(10 / 11, abs=1e-12) and metrics["evidence_exact_f1"] == 0.0


def test_unsupported_means_decisive_label_with_evidence_f1_below_the_reward_cap():
    truth = gold("REFUTES", ["alpha beta gamma delta epsilon"])
    at_threshold = scifact_example(completion("REFUTES", ["alpha x y z w"]), truth)  # 2*1/10 = 0.2: grounded
    below = scifact_example(completion("REFUTES", ["alpha x y z w v"]), truth)  # 2*1/11 = 0.18: unsupported
    nei = scifact_example(completion("NOT_ENOUGH_INFO", []), truth)  # not decisive: outside the rate
    assert at_threshold["evidence_f1"] == pytest.approx(0.2) and not at_threshold["unsupported"]
    assert below["evidence_f1"] == pytest.approx(2 / 11) and below["unsupported"]
    assert scifact_metrics([at_threshold, below, nei])["unsupported_rate"] == 0.5


RELAXED_CASES = [
    # a base model that answers in words: the label comes first
    ("Refutes. The second sentence contradicts it.", gold("REFUTES", [D])),
    # an echo of the instruction: the first label word anywhere would be SUPPORTS (right by accident)
    ("Does the text support or refute the claim? Answer SUPPORTS, REFUTES or NOT_ENOUGH_INFO", gold("SUPPORTS", [E])),
    # a thinking model: the reasoning before </think> is skipped, "Not enough information" counts
    ("<think>It supports the claim, or not.</think>\nNot enough information.", gold("NOT_ENOUGH_INFO", [])),
    # the answer block wins when it is there
    (completion("SUPPORTS", [A]), gold("REFUTES", [A])),
]


def test_scifact_relaxed_uses_the_prefix_constrained_label():
    relaxed = [scifact_example(text, truth, relaxed=True) for text, truth in RELAXED_CASES]
    assert [e["predicted_label"] for e in relaxed] == ["REFUTES", None, "NOT_ENOUGH_INFO", "SUPPORTS"]
    metrics = scifact_metrics(relaxed)
    # right: 1 and 3 of 4. Decisive: 1 (no evidence: unsupported) and 4 (A listed, gold A: F1 1.0) -> 1/2.
    assert metrics["answer_accuracy"] == 0.5 and metrics["prefix_label_accuracy"] == 0.5
    assert metrics["unsupported_rate"] == 0.5 and metrics["no_label_rate"] == 0.25 and metrics["nei_rate"] == 0.25
    strict = scifact_metrics([scifact_example(text, truth) for text, truth in RELAXED_CASES])
    # strict reads only the answer block (case 4, wrong); the prefix diagnostic column is the same in both modes
    assert strict["answer_accuracy"] == 0.0 and strict["no_label_rate"] == 0.75
    assert strict["prefix_label_accuracy"] == 0.5


def test_prefix_label_needs_the_label_first():
    assert prefix_label("SUPPORTS") == "SUPPORTS" and prefix_label("  <answer>\nnei\n</answer>") == "NOT_ENOUGH_INFO"
    assert prefix_label("Label: contradicts") == "REFUTES"
    assert prefix_label("## Final answer: *Supported*") == "SUPPORTS"
    assert prefix_label("It does not SUPPORT it") is None  # a label later in the reply does not count
    assert prefix_label("supportive evidence") is None and prefix_label("NEI-like") is None  # whole words only
    assert prefix_label("x" * 10**6 + " SUPPORTS") is None and prefix_label("") is None


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
