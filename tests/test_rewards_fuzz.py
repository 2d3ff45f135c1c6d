"""Property tests: every parser and reward on thousands of generated strings (tag soup, unicode, binary junk)
never raises, stays in its documented range and is deterministic; plus megabyte-sized inputs."""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_counter import MemoryCounter
from rewards import compute_score
from rewards.factqa import COUNT_REWARDS, make_factqa_reward
from rewards.parsing import extract_block, normalize_text, scoring_regions, split_sentences, token_f1
from rewards.triples import PRONOUNS, RuleTripleExtractor, parse_triple
from rewards.verifier import parse_judgment

PIECES = ["<think>", "</think>", "<answer>", "</answer>", "<evidence>", "</evidence>", "<ANSWER>", "</Think>",
          "\\boxed{", "}", "{", "\\text{", "Final Judgment:", "final judgement: ", "[Correct]", "[Incorrect]", "A", "B",
          "C", "SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO", "nei", "[1] ", "- ", "* ", ". ", "! ", "? ", ".", "\n", " ",
          "\t", "Marie Curie won the Nobel Prize", "She was born", "Paris is in France", "I don't know", "the",
          "vitamin D lowers risk", ";", "|", "é", "\u0301", "\u00a0", "\x00", "\ufffd", "İ", "ﬁ"]
fragment = st.one_of(st.sampled_from(PIECES), st.text(max_size=12),
                     st.binary(max_size=12).map(lambda data: data.decode("latin-1")))
completions = st.lists(fragment, max_size=40).map("".join)
FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCIFACT_GOLD = ['{"answer": "SUPPORTS", "evidence": ["Vitamin D lowers risk.", "Paris is in France."]}',
                '{"answer": "NOT_ENOUGH_INFO", "evidence": []}', "REFUTES"]
COUNTER = MemoryCounter(["Marie Curie won the Nobel Prize."] * 25 + ["Paris is in France."] * 3 + ["She was born."])
FACTQA = make_factqa_reward(COUNTER)
SENTENCE_REWARDS = {reward for _, reward in COUNT_REWARDS} | {0.0}


@FUZZ
@given(completions)
def test_sentence_spans(text):
    spans = split_sentences(text)
    assert spans == split_sentences(text)
    previous_end = 0
    for start, end in spans:
        assert previous_end <= start < end <= len(text)
        assert text[start:end] == text[start:end].strip()
        previous_end = end
    regions = scoring_regions(text)
    pattern = re.compile(r"<think>(.*?)</think>|<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
    expected = [match.span(1) if match.group(1) is not None else match.span(2) for match in pattern.finditer(text)]
    assert regions == (expected or [(0, len(text))])
    for start, end in spans:  # every span lies inside one region
        assert any(region_start <= start and end <= region_end for region_start, region_end in regions)


@FUZZ
@given(completions, st.sampled_from(["answer", "evidence", "think"]))
def test_extract_block_matches_regex(text, name):
    match = re.search(f"<{name}>(.*?)</{name}>", text, re.IGNORECASE | re.DOTALL)
    assert extract_block(text, name) == (match.group(1) if match else None)


@FUZZ
@given(completions, completions)
def test_normalize_and_f1(first, second):
    normalized = normalize_text(first)
    assert normalize_text(normalized) == normalized
    f1 = token_f1(first, second)
    assert 0.0 <= f1 <= 1.0 + 1e-12
    assert f1 == pytest.approx(token_f1(second, first), abs=1e-12)


@FUZZ
@given(completions, st.sampled_from(SCIFACT_GOLD), st.sampled_from(["scifact_evidence", "evidence_qa"]))
def test_evidence_rewards_in_range(text, gold, data_source):
    result = compute_score(data_source, text, gold)
    assert result == compute_score(data_source, text, gold)
    for key, value in result.items():
        assert 0.0 <= value <= 1.0 + 1e-12, key
    assert result["format"] in (0.0, 0.5, 1.0) and result["conciseness"] in (0.0, 1.0)


@FUZZ
@given(completions, st.sampled_from(["A", "B", "C"]))
def test_verifier_in_range(text, gold):
    judged = parse_judgment(text)
    assert judged in ("A", "B", "C", None)
    result = compute_score("verifier", text, gold)
    assert result["score"] in (0.0, 1.0) and result["parsed"] == float(judged is not None)


@FUZZ
@given(completions)
def test_factqa_in_range(text):
    result = FACTQA("factqa_corpus", text, "Marie Curie;Paris")
    assert result["score"] in (-2.0, 0.0, 1.0, 3.0)
    assert [(start, end) for start, end, _ in result["sentences"]] == split_sentences(text)[:64]
    assert all(reward in SENTENCE_REWARDS for _, _, reward in result["sentences"])
    assert result == FACTQA("factqa_corpus", text, "Marie Curie;Paris")


@FUZZ
@given(completions)
def test_triple_extraction_never_returns_pronouns(text):
    for triple in (RuleTripleExtractor().extract(text), parse_triple(text)):
        if triple is not None:
            assert triple.head.lower() not in PRONOUNS and triple.tail.lower() not in PRONOUNS
            assert triple.head and triple.relation and triple.tail


MEGABYTE = 1_000_000
HUGE = {
    "junk": bytes(range(256)).decode("latin-1") * (MEGABYTE // 256),
    "unclosed": "<answer>" * (MEGABYTE // 8),
    "closing": "</think>" * (MEGABYTE // 8),
    "alternating": "<think><answer>" * (MEGABYTE // 15),
    "nested": "<think>" + "<answer>Paris is in France. " * (MEGABYTE // 30) + "</think>",
    "boxed": "\\boxed{" * (MEGABYTE // 7),
    "sentences": "Marie Curie won the Nobel Prize. " * (MEGABYTE // 33),
    "one_sentence": "word " * (MEGABYTE // 5),
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_megabyte_inputs(name):
    text = HUGE[name]
    assert 0.0 <= compute_score("scifact_evidence", text, SCIFACT_GOLD[0])["score"] <= 1.0
    assert 0.0 <= compute_score("evidence_qa", text, SCIFACT_GOLD[0])["score"] <= 1.0
    assert compute_score("verifier", text, "A")["score"] in (0.0, 1.0)
    result = FACTQA("factqa_corpus", text, "Paris")
    assert result["score"] in (-2.0, 0.0, 1.0, 3.0) and len(result["sentences"]) <= 64
