"""Verifier reward: judgment parsing (boxed, bare letter, xVerify tags), gold labels, the prompt template."""
import pytest

from rewards import compute_score
from rewards.verifier import gold_judgment, last_boxed_span, parse_judgment, verifier_prompt, verifier_template


@pytest.mark.parametrize("text, expected", [
    ("Reasoning... Final Judgment: \\boxed{A}", "A"),
    ("\\boxed{A} first, then changed my mind: \\boxed{B}", "B"),        # the last box wins
    ("Final Judgment: \\boxed{\\text{C}}", "C"),
    ("\\boxed{ (B) }", "B"),
    ("\\boxed{A: equivalent}", "A"),
    ("Final Judgment: C", "C"),                                           # trailing bare letter
    ("Final Judgment: B.", "B"),
    ("final judgement:   **A**", "A"),
    ("Final Judgment: A\n\nThat is all.", "A"),
    ("Final Judgment: B then Final Judgment: A", "A"),                    # the last marker
    ("Final Judgment: Apples", None),                                     # not a bare letter
    ("\\boxed{D}\nFinal Judgment: B", "B"),                              # invalid box, bare letter after it
    ("The candidate is [Correct]", "A"),
    ("[correct] ... [INCORRECT]", "B"),
    ("\\boxed{B} [Correct]", "B"),                                       # a box before an xVerify tag
    ("The answer is A", None),                                            # a letter alone is not a judgment
    ("\\boxed{A", None),                                                  # unbalanced box
    ("", None),
])
def test_parse_judgment(text, expected):
    assert parse_judgment(text) == expected


def test_last_boxed_span_ends_at_the_closing_brace():
    text = "so \\boxed{\\text{A}} ."
    start, end = last_boxed_span(text)
    assert (text[start:end], text[end + 1:]) == ("\\text{A}", " .")


@pytest.mark.parametrize("ground_truth, expected", [
    ("A", "A"), ("b", "B"), (" C ", "C"), ("(A)", "A"), ("correct", "A"), ("Incorrect", "B"), ("incomplete", "C"),
    ("[Correct]", "A"), ('{"label": "B"}', "B"), ({"judgment": "C"}, "C"), ('{"answer": true}', "A"),
    ('{"target": false}', "B"),
])
def test_gold_judgment(ground_truth, expected):
    assert gold_judgment(ground_truth) == expected


@pytest.mark.parametrize("ground_truth, field", [
    ("D", "'ground_truth'"), ('{"label": "maybe"}', "'label'"), ('{"other": "A"}', "'label'"), (None, "ground_truth"),
    ('{"label": 1}', "'label'"),
])
def test_malformed_gold_names_the_field(ground_truth, field):
    with pytest.raises(ValueError, match=field):
        compute_score("verifier", "Final Judgment: \\boxed{A}", ground_truth)


@pytest.mark.parametrize("judgment, gold, score", [
    ("A", "A", 1.0), ("B", "A", 0.0), ("C", "A", 0.0),
    ("A", "B", 0.0), ("B", "B", 1.0), ("C", "B", 1.0),
    ("A", "C", 0.0), ("B", "C", 1.0), ("C", "C", 1.0),
])
def test_reward_is_agreement_on_correct_versus_not(judgment, gold, score):
    result = compute_score("verifier", f"Looks fine.\nFinal Judgment: \\boxed{{{judgment}}}", gold)
    assert result["score"] == result["correct"] == score
    assert result["parsed"] == 1.0
    assert (result["judged_a"], result["judged_b"], result["judged_c"]) == tuple(float(judgment == x) for x in "ABC")


@pytest.mark.parametrize("gold", ["A", "B", "C"])
def test_unparsable_scores_zero(gold):
    result = compute_score("verifier", "I think the candidate is right.", gold)
    assert result == {"score": 0.0, "correct": 0.0, "parsed": 0.0, "judged_a": 0.0, "judged_b": 0.0, "judged_c": 0.0}


def test_prompt_template_is_package_data_and_fills_once():
    template = verifier_template()
    for placeholder in ("{question}", "{reference}", "{candidate}"):
        assert template.count(placeholder) == 1
    assert "Final Judgment: \\boxed{X}" in template
    prompt = verifier_prompt("What is {reference}?", "4", "four {candidate}")
    assert "What is {reference}?" in prompt  # a field's own text is not substituted again
    assert "four {candidate}" in prompt
    assert "\n4\n" in prompt
    assert "{question}" not in prompt
