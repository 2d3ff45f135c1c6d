"""The generated evidence task: deterministic, balanced, decidable from its gold sentence, in the SciFact format."""
import json
import random
import re
from collections import Counter

import pytest

from data import synthetic
from data.scifact import INSTRUCTIONS, evidence_prompt
from data.rows import read_rows


@pytest.fixture(scope="module")
def rows():
    return synthetic.generate_rows(300, seed=0)


def test_same_seed_same_rows_other_seed_other_rows(rows):
    assert synthetic.generate_rows(300, seed=0) == rows
    assert synthetic.generate_rows(30, seed=1) != synthetic.generate_rows(30, seed=0)


@pytest.mark.parametrize("n", [1, 2, 7, 300])
def test_labels_are_balanced(n):
    counts = Counter(row["extra_info"]["label"] for row in synthetic.generate_rows(n, seed=3))
    assert sum(counts.values()) == n
    assert max(counts.values()) - min(counts.get(label, 0) for label in ("SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO")) <= 1


def sentences_of(prompt):
    return re.findall(r"^\[(\d+)\] (.*)$", prompt.split("\n\nTitle: ")[1].split("\n\n")[0], flags=re.M)


def test_rows_use_the_scifact_prompt_and_target_format(rows):
    for row in rows:
        info, prompt = row["extra_info"], row["prompt"][0]["content"]
        assert row["data_source"] == "scifact_evidence" and len(row["prompt"]) == 1
        numbered = sentences_of(prompt)
        assert [int(i) for i, _ in numbered] == list(range(len(numbered))) and 3 <= len(numbered) <= 4
        claim = prompt.split("\n")[0].removeprefix("Claim: ")
        assert prompt == evidence_prompt(claim, synthetic.TITLE, [text for _, text in numbered])
        gold = [numbered[i][1] for i in info["evidence_indices"]]
        assert json.loads(row["reward_model"]["ground_truth"]) == {"answer": info["label"], "evidence": gold}
        lines = "".join(f"[{k}] {sentence}\n" for k, sentence in enumerate(gold, start=1))
        assert info["target"] == f"<answer>\n{info['label']}\n</answer>\n\n<evidence>\n{lines}</evidence>"
        assert len(gold) == (0 if info["label"] == "NOT_ENOUGH_INFO" else 1)


def parse_claim(claim):
    """(attribute, entity, value) of a claim, by matching the claim templates."""
    for attribute, (_, claim_template, _) in synthetic.ATTRIBUTES.items():
        pattern = re.escape(claim_template).replace(r"\{entity\}", "(?P<entity>.+)").replace(r"\{value\}", "(?P<value>.+)")
        match = re.fullmatch(pattern, claim)
        if match:
            return attribute, match["entity"], match["value"]
    raise AssertionError(f"claim {claim!r} matches no template")


def stated(sentence, attribute, entity):
    """The value `sentence` states for the entity's attribute, or None."""
    pattern = re.escape(synthetic.ATTRIBUTES[attribute][0]).replace(r"\{entity\}", re.escape(entity))
    match = re.fullmatch(pattern.replace(r"\{value\}", "(?P<value>.+)"), sentence)
    return match["value"] if match else None


def test_the_label_follows_from_exactly_one_sentence(rows):
    for row in rows:
        info, prompt = row["extra_info"], row["prompt"][0]["content"]
        attribute, entity, value = parse_claim(prompt.split("\n")[0].removeprefix("Claim: "))
        sentences = [text for _, text in sentences_of(prompt)]
        # Only the gold sentence speaks to the claimed attribute, of any company, and it names the claimed one.
        any_company = re.escape(synthetic.ATTRIBUTES[attribute][0]).replace(r"\{entity\}", ".+").replace(r"\{value\}", ".+")
        deciding = [i for i, sentence in enumerate(sentences) if re.fullmatch(any_company, sentence)]
        assert deciding == info["evidence_indices"]
        assert entity in " ".join(sentences)  # the claimed company is always mentioned, NOT_ENOUGH_INFO included
        if info["label"] != "NOT_ENOUGH_INFO":
            told = stated(sentences[deciding[0]], attribute, entity)
            assert told is not None
            assert (told == value) == (info["label"] == "SUPPORTS")


def test_prompts_are_short(rows):
    # The chat-rendered prompt must stay near 200 SmolLM2 tokens; at ~3.6 characters per token here,
    # 620 characters of user message is about 170 tokens plus ~30 for the chat template.
    lengths = [len(row["prompt"][0]["content"]) for row in rows]
    assert max(lengths) <= 620, max(lengths)
    assert len(INSTRUCTIONS) <= 330


def test_entities_are_distinct_within_an_example():
    rng = random.Random(0)
    for _ in range(200):
        claim, sentences, evidence = synthetic.generate_example(rng, "SUPPORTS")
        assert len(set(sentences)) == len(sentences)


def test_cli(tmp_path, capsys):
    out = tmp_path / "syn.jsonl"
    synthetic.main(["--n", "12", "--seed", "5", "--out", str(out), "--split", "heldout"])
    assert read_rows(out) == synthetic.generate_rows(12, seed=5, split="heldout")
    with pytest.raises(SystemExit, match="n must be at least 1"):
        synthetic.main(["--n", "0", "--out", str(tmp_path / "none.jsonl")])
    assert not (tmp_path / "none.jsonl").exists()


def test_targets_get_the_full_scifact_evidence_reward(rows):
    from rewards import compute_score

    for row in rows:
        result = compute_score(row["data_source"], row["extra_info"]["target"], row["reward_model"]["ground_truth"])
        assert result["score"] == 1.0 and result["format"] == 1.0
