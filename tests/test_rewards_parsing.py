"""Shared parsing helpers: normalisation, token F1, tag blocks, sentence spans, the think/answer format."""
import re

import pytest

from rewards.parsing import (
    extract_block,
    load_ground_truth,
    normalize_text,
    scoring_regions,
    split_sentences,
    think_answer_format,
    token_f1,
)


@pytest.mark.parametrize("text, expected", [
    ("Hello,   World!", "hello world"),
    ("snake_case-and.dots", "snake case and dots"),
    ("\tTabs\nand\r\nnewlines ", "tabs and newlines"),
    ("(p<0.05)", "p 0 05"),
    ("", ""),
    ("Ünïcode — dash", "ünïcode — dash"),  # only ASCII punctuation is replaced
    ("  The IL-6 receptor_alpha (sIL6R)!  ", "the il 6 receptor alpha sil6r"),
])
def test_normalize_text(text, expected):
    assert normalize_text(text) == expected


@pytest.mark.parametrize("prediction, gold, expected", [
    ("a b c", "a b c", 1.0),
    ("a b", "a b c d", 2 * (1 * 0.5) / 1.5),       # P=1, R=0.5
    ("a a b", "a b b", 2 * (2 / 3) * (2 / 3) / (4 / 3)),  # shared: min(2,1)+min(1,2) = 2
    ("x y", "a b", 0.0),
    ("", "a", 0.0),
    ("a", "", 0.0),
    ("!!!", "a", 0.0),  # normalises to nothing
    ("The Cat.", "the cat", 1.0),
    ("Vitamin D lowers risk", "vitamin d lowers the risk of fracture", 0.7272727272727273),  # 2*4 / (4 + 7)
])
def test_token_f1(prediction, gold, expected):
    assert token_f1(prediction, gold) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("text", [
    "<answer>x</answer>", "<ANSWER>\nmulti\nline</Answer>", "<answer><answer>x</answer></answer>",
    "<answer>unclosed", "</answer><answer>y</answer>", "<answer></answer>", "no tags", "",
    "<answer>a</answer><answer>b</answer>", "<answer>" * 5 + "</answer>",
])
def test_extract_block_equals_the_specified_regex(text):
    match = re.search(r"<answer>(.*?)</answer>", text, re.IGNORECASE | re.DOTALL)
    assert extract_block(text, "answer") == (match.group(1) if match else None)


def test_extract_block_returns_raw_content():
    assert extract_block("pre <evidence>\n[1] a\n</evidence> post", "evidence") == "\n[1] a\n"
    assert extract_block("<evidence>", "evidence") is None
    assert extract_block("x <ANSWER>\nSUPPORTS\n</answer> <answer>no</answer>", "answer") == "\nSUPPORTS\n"


@pytest.mark.parametrize("text, expected", [
    ("Paris is big. It is old!", ["Paris is big.", "It is old!"]),
    ("<think>One. Two?</think>\n<answer>Three.</answer>", ["One.", "Two?", "Three."]),
    ("<think>\n  Padded.  \n</think>", ["Padded."]),
    ("no terminal punctuation", ["no terminal punctuation"]),
    ("3.14 is pi. e is 2.71.", ["3.14 is pi.", "e is 2.71."]),  # no whitespace after the inner dots
    ("<think>unclosed. Two.", ["<think>unclosed.", "Two."]),  # no complete block: the whole text
    ("<think>outer <answer>inner.</answer> tail.</think>", ["outer <answer>inner.</answer> tail."]),
    ("<think></think><answer> </answer>", []),
    ("", []),
    ("   ", []),
    ("Wait...   what?!  Yes.", ["Wait...", "what?!", "Yes."]),
])
def test_split_sentences(text, expected):
    spans = split_sentences(text)
    assert [text[start:end] for start, end in spans] == expected


def test_sentence_spans_tile_each_region():
    text = "<think>Alpha beta. Gamma!\n\nDelta? Epsilon</think> junk <answer> Final. </answer>"
    regions = scoring_regions(text)
    assert regions == [(7, 41), (63, 71)]
    spans = split_sentences(text)
    assert [text[start:end] for start, end in spans] == ["Alpha beta.", "Gamma!", "Delta?", "Epsilon", "Final."]
    for region_start, region_end in regions:
        inside = [(start, end) for start, end in spans if region_start <= start < region_end]
        # spans and the whitespace between them tile the region: before the first span, between spans and
        # after the last one there is only whitespace
        edges = [region_start, *[edge for span in inside for edge in span], region_end]
        gaps = [text[edges[index]:edges[index + 1]] for index in range(0, len(edges), 2)]
        assert all(gap.strip() == "" for gap in gaps)


def test_scoring_regions_match_the_alternation_regex():
    pattern = re.compile(r"<think>(.*?)</think>|<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
    for text in ["<think>a</think><answer>b</answer>", "<answer>b</answer><think>a</think>",
                 "<think>a<answer>b</answer>c</think>", "<think>x <answer>y</answer>", "<answer>unclosed <think>t</think>",
                 "<THINK>a</think>", "<think>a</think><think>b</think>"]:
        expected = [match.span(1) if match.group(1) is not None else match.span(2) for match in pattern.finditer(text)]
        assert scoring_regions(text) == (expected or [(0, len(text))])


@pytest.mark.parametrize("text, expected", [
    ("<think>Paris is the capital.</think><answer>Paris</answer>", True),
    ("  <think>Paris is the capital.</think>\n\n<answer>Paris</answer>\n", True),
    ("<think>Paris is the capital.</think>\n<answer>Paris</answer>", True),
    ("<THINK>Paris is the capital.</THINK><ANSWER>Paris</ANSWER>", True),
    ("<think>two words</think><answer>Paris</answer>", False),          # trivial think
    ("<think>Paris is the capital.</think><answer>  </answer>", False),  # empty answer
    ("<answer>Paris</answer><think>Paris is the capital.</think>", False),
    ("Sure! <think>Paris is the capital.</think><answer>Paris</answer>", False),
    ("<think>Paris is the capital.</think> then <answer>Paris</answer>", False),
    ("<think>Paris is the capital.</think><answer>Paris</answer> more", False),
    ("<think>a b c <think> d</think><answer>Paris</answer>", False),       # a tag twice
    ("<think>Paris is the capital.</think><answer>Paris", False),
    ("", False),
])
def test_think_answer_format(text, expected):
    assert think_answer_format(text) is expected


def test_load_ground_truth():
    assert load_ground_truth({"a": 1}) == {"a": 1}
    assert load_ground_truth('{"a": [1]}') == {"a": [1]}
    assert load_ground_truth('["x", "y"]') == ["x", "y"]
    assert load_ground_truth("{not json") == "{not json"
    assert load_ground_truth('{"answer": "SUPPORTS"}') == {"answer": "SUPPORTS"}
    assert load_ground_truth("Paris;City of Light") == "Paris;City of Light"
    assert load_ground_truth(20) == "20"
    assert load_ground_truth("42") == "42"
    assert load_ground_truth(42) == "42" and load_ground_truth(2.5) == "2.5"  # verl's rows carry numbers (issue 31)
    with pytest.raises(ValueError, match="ground_truth"):
        load_ground_truth(None)
