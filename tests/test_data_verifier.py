"""Verifier rows from the shipped fixture: judgments, prompt template filling, 1:1 rebalancing, bad input."""
import json
from collections import Counter
from pathlib import Path

import pytest

from data import verifier
from data.rows import read_rows
from rewards.verifier import verifier_prompt

FIXTURE = Path(verifier.__file__).parent / "fixtures" / "verifier_sample.jsonl"
TEMPLATE = (
    "Question: {question}\nReference answer: {reference}\nCandidate answer: {candidate}\n"
    "Judge A (correct), B (incorrect) or C (incomplete or refusal). End with Final Judgment: \\boxed{X}."
)


@pytest.fixture(scope="module")
def rows():
    return verifier.convert_verifier(FIXTURE, TEMPLATE)


def test_fixture_rows(rows):
    assert len(rows) == 20
    # The fixture's judgments: A/a/true/True count as A (13 rows); B, C, false as written (7 rows).
    assert Counter(row["reward_model"]["ground_truth"] for row in rows) == {"A": 13, "B": 5, "C": 2}
    first = rows[0]
    assert first["data_source"] == "verifier" and first["extra_info"]["domain"] == "math"
    assert first["prompt"] == [{"role": "user", "content": (
        "Question: What is 12 times 12?\nReference answer: 144\nCandidate answer: 12 x 12 = 144, so the answer is 144.\n"
        "Judge A (correct), B (incorrect) or C (incomplete or refusal). End with Final Judgment: \\boxed{X}.")}]
    assert first["extra_info"]["target"] == "Final Judgment: \\boxed{A}"
    assert [row["extra_info"]["index"] for row in rows] == list(range(20))


def test_rebalance_is_one_to_one_deterministic_and_order_keeping(rows):
    balanced = verifier.rebalance(rows, seed=0)
    correct = [row for row in balanced if row["extra_info"]["correct"]]
    assert len(balanced) == 14 and len(correct) == 7
    # Every incorrect row (the rarer class) is kept; the input order is kept.
    assert [row for row in rows if not row["extra_info"]["correct"]] == [row for row in balanced if not row["extra_info"]["correct"]]
    indices = [row["extra_info"]["index"] for row in balanced]
    assert indices == sorted(indices)
    assert verifier.rebalance(rows, seed=0) == balanced
    assert any(verifier.rebalance(rows, seed=s) != balanced for s in range(1, 5))
    with pytest.raises(ValueError, match="cannot rebalance: 13 correct and 0 incorrect"):
        verifier.rebalance([row for row in rows if row["extra_info"]["correct"]])


def convert_one(tmp_path, judgment):
    """convert_verifier on a one-line file whose gold judgment is `judgment`."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question": "q", "gold_answer": "g", "llm_response": "r", "gold_judgment": judgment}))
    return verifier.convert_verifier(path, TEMPLATE)


@pytest.mark.parametrize("value, letter", [("A", "A"), (" c ", "C"), ("b", "B"), (True, "A"), (False, "B"), ("FALSE", "B"), ("true", "A")])
def test_parse_judgment(tmp_path, value, letter):
    assert convert_one(tmp_path, value)[0]["reward_model"]["ground_truth"] == letter


@pytest.mark.parametrize("value", ["D", "", 1, None, "yes"])
def test_parse_judgment_rejects(tmp_path, value):
    with pytest.raises(ValueError, match=":1: field 'gold_judgment' is"):
        convert_one(tmp_path, value)


def test_template_filling_is_literal():
    assert verifier_prompt("What is {reference}?", "x", "{question}", TEMPLATE).startswith(
        "Question: What is {reference}?\nReference answer: x\nCandidate answer: {question}\n")
    with pytest.raises(ValueError, match=r"lacks the placeholder\(s\) \{candidate\}"):
        verifier_prompt("q", "g", "r", "{question} {reference}")


def test_default_template_is_the_rewards_one_and_targets_score_full_reward():
    from rewards import compute_score

    rows = verifier.convert_verifier(FIXTURE)
    record = json.loads(FIXTURE.read_text().splitlines()[1])
    assert rows[1]["prompt"][0]["content"] == verifier_prompt(record["question"], record["gold_answer"], record["llm_response"])
    for row in rows:  # the SFT target parses to the gold judgment: the reward gives it 1
        result = compute_score(row["data_source"], row["extra_info"]["target"], row["reward_model"]["ground_truth"])
        assert result["score"] == 1.0


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "q", "gold_answer": "g", "llm_response": "r"}, ":2: missing field 'gold_judgment'"),
        ({"question": "q", "gold_answer": 4, "llm_response": "r", "gold_judgment": "A"}, ":2: field 'gold_answer' must be str"),
        ({"question": "q", "gold_answer": "g", "llm_response": "r", "gold_judgment": "maybe"}, ":2: field 'gold_judgment' is 'maybe'"),
    ],
)
def test_bad_lines(tmp_path, record, message):
    path = tmp_path / "v.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message):
        verifier.convert_verifier(path, TEMPLATE)


def test_cli(tmp_path, capsys):
    template = tmp_path / "template.txt"
    template.write_text(TEMPLATE)
    out = tmp_path / "out.jsonl"
    verifier.main(["--input", str(FIXTURE), "--out", str(out), "--template", str(template), "--seed", "0"])
    assert read_rows(out) == verifier.rebalance(verifier.convert_verifier(FIXTURE, TEMPLATE), seed=0)
    assert "14 rows (7 correct, 7 incorrect)" in capsys.readouterr().out
    verifier.main(["--input", str(FIXTURE), "--out", str(out), "--template", str(template), "--no-rebalance"])
    assert len(read_rows(out)) == 20
    with pytest.raises(SystemExit, match="the file is empty"):
        (tmp_path / "empty.jsonl").write_text("")
        verifier.main(["--input", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x.jsonl"), "--template", str(template)])
    assert not (tmp_path / "x.jsonl").exists()
