"""Token-to-sentence alignment: spans from incremental decoding, midpoint rule, shaping values."""
import pytest
import torch

from grpo.alignment import sentence_shaping, token_char_spans, token_sentence_index


def test_spans_tile_text_and_survive_partial_characters():
    # A byte-level BPE that splits "é" over two tokens decodes the first half as U+FFFD.
    prefixes = ["", "Caf", "Caf\ufffd", "Café", "Café is"]
    spans = token_char_spans(prefixes)
    assert spans == [(0, 3), (3, 4), (4, 4), (4, 7)]
    assert spans[0][0] == 0 and spans[-1][1] == len(prefixes[-1])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_midpoint_rule_reference():
    # Text "<answer>Paris is big. It is old.</answer>"; sentences [8, 21) and [22, 32).
    # Tokens: "<answer>" [0,8) mid 4 -> -1; "Paris" [8,13) -> 0; " is big." [13,21) -> 0;
    # " It" [21,24) mid 22.5 -> 1; " is old." [24,32) -> 1; "</answer>" [32,41) -> -1; EOS (41,41) -> -1.
    tokens = [(0, 8), (8, 13), (13, 21), (21, 24), (24, 32), (32, 41), (41, 41)]
    index = token_sentence_index(tokens, [(8, 21), (22, 32)])
    assert index.tolist() == [-1, 0, 0, 1, 1, -1, -1]
    shaping = sentence_shaping(index, [0.1, -0.3], coef=2.0)
    torch.testing.assert_close(shaping, torch.tensor([0, 0.2, 0.2, -0.6, -0.6, 0, 0]), rtol=0, atol=0)


def test_midpoint_on_boundary_goes_to_the_sentence_that_starts_there():
    # Token [4, 8) has midpoint 6 exactly: end-exclusive spans put it in [6, 10), not [0, 6).
    assert token_sentence_index([(4, 8)], [(0, 6), (6, 10)]).tolist() == [1]


def test_empty_inputs():
    assert token_sentence_index([], [(0, 3)]).tolist() == []
    assert token_sentence_index([(0, 2)], []).tolist() == [-1]
    assert sentence_shaping(torch.tensor([-1, -1]), [], coef=1.0).tolist() == [0.0, 0.0]


def test_bad_spans():
    with pytest.raises(ValueError, match="end < start"):
        token_sentence_index([(3, 1)], [(0, 4)])
    with pytest.raises(ValueError, match=r"sentence_char_spans must be a list of \(start, end\) pairs"):
        token_sentence_index([(0, 1)], [(0, 1, 2)])
    with pytest.raises(ValueError, match="only 1 rewards"):
        sentence_shaping(torch.tensor([0, 1]), [0.1])
