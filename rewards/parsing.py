"""Text helpers for the rewards: normalisation, token F1, tag blocks, sentence spans and JSON ground truth.

Every function is total on strings (no input raises) and linear in the text length (no regex that backtracks
over the whole text), since completions can be megabytes of junk."""
from __future__ import annotations

import contextlib
import functools
import json
import re
import string
from collections import Counter

_PUNCTUATION_TO_SPACE = str.maketrans({character: " " for character in string.punctuation})
_SENTENCE = re.compile(r"\S+(?:(?<![.!?])\s+\S+)*")  # words joined by whitespace that follows no . ! or ?
_OPENING = re.compile(r"<(?:(think)|answer)>", re.IGNORECASE)
_WORD = re.compile(r"[^\W_]+")
_THINK_ANSWER = re.compile(r"\s*<think>(.*)</think>\s*<answer>(.*)</answer>\s*", re.IGNORECASE | re.DOTALL)
MIN_THINK_WORDS = 3


def normalize_text(text: str) -> str:
    """Lower-case, `_` and every ASCII punctuation character to a space, whitespace collapsed."""
    return " ".join(text.lower().translate(_PUNCTUATION_TO_SPACE).split())


def token_bag(text: str) -> Counter:
    """The normalize_text tokens of a text with their counts (a gold side is built once per ground truth)."""
    return Counter(normalize_text(text).split())


def bag_f1(prediction: Counter, gold: Counter) -> float:
    """Token F1 = 2*shared / (len(prediction) + len(gold)) = 2PR/(P+R), shared = the sum over common tokens of
    the smaller count (the common tokens found by a set intersection in C); 0 when none is shared."""
    shared = sum(min(prediction[token], gold[token]) for token in prediction.keys() & gold.keys())
    return 2 * shared / (prediction.total() + gold.total()) if shared else 0.0


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD-style token F1 over normalize_text tokens; 0 when either side is empty."""
    return bag_f1(token_bag(prediction), token_bag(gold))


@functools.cache
def _tag(name: str, closing: bool) -> re.Pattern:
    return re.compile(re.escape(f"</{name}>" if closing else f"<{name}>"), re.IGNORECASE)


def extract_block(text: str, name: str) -> str | None:
    """The content (whitespace kept) of the first `<name>...</name>` block, or None: the group of
    `re.search(f"<{name}>(.*?)</{name}>", text, re.I | re.S)`, found by two literal searches (the first opening
    tag, then the first closing tag after it), linear where that regex is quadratic on unclosed tags."""
    opening = _tag(name, closing=False).search(text)
    closing = None if opening is None else _tag(name, closing=True).search(text, opening.end())
    return None if closing is None else text[opening.end():closing.start()]


def scoring_regions(text: str) -> list[tuple[int, int]]:
    """Content spans of the `<think>` and `<answer>` blocks, left to right, as the alternation regex
    `<think>(.*?)</think>|<answer>(.*?)</answer>` (re.I | re.S) finds them (a block nested in another is part of
    the outer one); the whole text when there is no complete block. Linear, where that regex is quadratic on
    unclosed tags: an opening tag matches when its kind's last closing tag lies after it.

    >>> scoring_regions("<think>a. b.</think><answer>c</answer>"), scoring_regions("no tags")
    ([(7, 12), (28, 29)], [(0, 7)])
    """
    last_closing = {name: max((tag.start() for tag in _tag(name, closing=True).finditer(text)), default=-1)
                    for name in ("think", "answer")}
    regions: list[tuple[int, int]] = []
    position = 0
    for opening in _OPENING.finditer(text):
        name = "think" if opening.group(1) else "answer"
        if opening.start() >= position and last_closing[name] >= opening.end():
            closing = _tag(name, closing=True).search(text, opening.end())
            regions.append((opening.end(), closing.start()))
            position = closing.end()
    return regions or [(0, len(text))]


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans `(start, end)` of the text, sorted, in scoring_regions only. A sentence ends at `.`, `!`
    or `?` followed by whitespace; spans are trimmed, so only whitespace lies between two spans of a block.

    >>> text = "<think>Paris is in France. It is big!</think><answer>Paris</answer>"
    >>> [text[start:end] for start, end in split_sentences(text)]
    ['Paris is in France.', 'It is big!', 'Paris']
    """
    return [sentence.span() for start, end in scoring_regions(text)
            for sentence in _SENTENCE.finditer(text, start, end)]


def think_answer_format(text: str) -> bool:
    """True for exactly `<think>T</think><answer>A</answer>`, each tag once (case-insensitive), only whitespace
    around and between the blocks, at least MIN_THINK_WORDS words in T and a non-empty A."""
    if any(len(_tag(name, closing).findall(text)) != 1 for name in ("think", "answer") for closing in (False, True)):
        return False
    match = _THINK_ANSWER.fullmatch(text)  # with every tag once, linear
    return match is not None and len(_WORD.findall(match.group(1))) >= MIN_THINK_WORDS and bool(match.group(2).strip())


def load_ground_truth(ground_truth: object) -> object:
    """A dict or list as it is, a string holding a JSON object or array decoded, a number as its text and any
    other string unchanged (a plain answer); ValueError for other types."""
    if isinstance(ground_truth, (dict, list)):
        return ground_truth
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    if not isinstance(ground_truth, str):
        raise ValueError(f"field 'ground_truth' must be a string, number, list or dict, got "
                         f"{type(ground_truth).__name__}")
    stripped = ground_truth.strip()
    if stripped[:1] in ("{", "["):
        with contextlib.suppress(json.JSONDecodeError):  # else a plain answer that happens to start with a bracket
            return json.loads(stripped)
    return ground_truth
