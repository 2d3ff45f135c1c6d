"""What a co-occurrence count is, independent of where the token positions come from (rewards/corpus.py:
infini-gram; tests/memory_counter.py: a token array).

count_cooccurrence counts how often every query phrase (an AND term) occurs within `window` tokens of the
others; a phrase matches where any of its token variants does (an OR), and a phrase with an unknown word counts
0. Two definitions of "within the window" (docs/recipes.md, "Corpus counts", says why the first is the default):

"engine": exactly infini-gram's `count_cnf(cnf, max_diff_tokens=window)`, the count the corpus paper's
thresholds were calibrated on. Each occurrence of the rarest clause starts a range [l, r]; each further clause
(fewest occurrences first) extends every range to its nearest occurrence before r if that lies at most
`window` before l, and to its nearest at or after l if that lies at most `window` after r; a range takes
both sides when both qualify (then it counts once per side), else the one that does, else it is dropped.
Ranges spanning a document separator are dropped, and the count is scaled back by the clauses' subsampling
factors (integer ratios, as the engine computes them).

"document": the occurrences of the rarest phrase with every other phrase starting within `window` tokens in
the SAME document, each side checked separately (where the engine's range takes a nearer partner from a
neighbouring document, crosses the separator and is dropped, this count keeps the occurrence)."""
from __future__ import annotations

import contextlib
import re
import unicodedata
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
from cachetools import LRUCache

SEMANTICS = ("engine", "document")  # checked by the callers: grpo.config's schema, the CLI's choices
_WORD = re.compile(r"[^\W_]+")


class Clause(NamedTuple):
    """One phrase's occurrences: positions [N] int64 sorted (start of each, in the counter's units), documents
    [N] int64 (document of each), scale (> 1 for a subsample: the engine's ratio total // N) and total
    (occurrences before subsampling, by which the engine orders the clauses)."""

    positions: np.ndarray
    documents: np.ndarray
    scale: float
    total: int


def document_window_count(clauses: Sequence[Clause], window: int) -> int:
    """The "document" definition (module docstring). Only the nearest partner on each side of an anchor needs
    checking: documents being contiguous, a farther one is not in a nearer document."""
    clauses = sorted(clauses, key=lambda clause: len(clause.positions) * clause.scale)
    anchor_positions, anchor_documents, anchor_scale, _ = clauses[0]
    keep = np.ones(len(anchor_positions), dtype=bool)
    for positions, documents, _, _ in clauses[1:]:
        right = np.searchsorted(positions, anchor_positions, side="left")  # first partner at or after the anchor
        left = right - 1
        has_left, has_right = left >= 0, right < len(positions)
        left_index, right_index = np.where(has_left, left, 0), np.where(has_right, right, 0)
        left_ok = has_left & (documents[left_index] == anchor_documents)
        left_ok &= anchor_positions - positions[left_index] <= window
        right_ok = has_right & (documents[right_index] == anchor_documents)
        right_ok &= positions[right_index] - anchor_positions <= window
        keep &= left_ok | right_ok
    return int(int(keep.sum()) * anchor_scale)


def engine_window_count(clauses: Sequence[Clause], window: int, separators: np.ndarray) -> int:
    """The "engine" definition (module docstring), vectorised over the ranges. separators: [D] int64 sorted,
    each document's separator position; a range [l, r] is dropped when a separator s has l <= s < r."""
    clauses = sorted(clauses, key=lambda clause: clause.total)  # stable, like the engine's sort
    left, right, scale = clauses[0].positions.copy(), clauses[0].positions.copy(), clauses[0].scale
    for positions, _, clause_scale, _ in clauses[1:]:
        before = np.searchsorted(positions, right, side="left") - 1  # the last occurrence < r
        after = np.searchsorted(positions, left, side="left")  # the first occurrence >= l
        has_before, has_after = before >= 0, after < len(positions)
        new_left = np.minimum(left, positions[np.where(has_before, before, 0)])
        new_right = np.maximum(right, positions[np.where(has_after, after, 0)])
        left_ok = has_before & (new_left + window >= left)
        right_ok = has_after & (new_right <= right + window)
        both, only_left, only_right = left_ok & right_ok, left_ok & ~right_ok, right_ok & ~left_ok
        left = np.concatenate([new_left[both], new_left[only_left], left[only_right]])
        right = np.concatenate([new_right[both], right[only_left], new_right[only_right]])
        scale *= clause_scale
    crossing = np.searchsorted(separators, right, side="left") > np.searchsorted(separators, left, side="left")
    return int(int((~crossing).sum()) * scale)


class WordTokenizer:
    """Word-level tokenizer fitted on the corpus, no download: NFKC, lower-case, words are runs of letters or
    digits, ids 1.. by descending frequency (0 is the engine's end-of-document id). Every word of the corpus
    gets an id (a rare entity counts like any other word); a word outside it encodes as UNKNOWN_ID."""

    UNKNOWN_ID = -2  # never stored in an index: a fitted vocabulary holds every word of its corpus

    def __init__(self, vocabulary: Sequence[str]) -> None:
        self.vocabulary = list(vocabulary)
        self.ids = {word: index + 1 for index, word in enumerate(self.vocabulary)}
        if len(self.ids) != len(self.vocabulary):
            raise ValueError("a word vocabulary must not repeat a word")

    @staticmethod
    def words(text: str) -> list[str]:
        return _WORD.findall(unicodedata.normalize("NFKC", text).lower())

    @classmethod
    def fit(cls, texts: Iterable[str]) -> WordTokenizer:
        counts = Counter(word for text in texts for word in cls.words(text))
        return cls(sorted(counts, key=lambda word: (-counts[word], word)))

    def encode(self, text: str) -> list[int]:
        """Ids of every word, UNKNOWN_ID for a word outside the vocabulary."""
        return [self.ids.get(word, self.UNKNOWN_ID) for word in self.words(text)]

    def variants(self, phrase: str) -> list[list[int]]:
        """[ids] of the phrase, or [] when a word is unknown or there is no word (neither can occur)."""
        ids = [self.ids.get(word) for word in self.words(phrase)]
        return [ids] if ids and None not in ids else []


class ExternalTokenizer:
    """Any `encode_fn(text) -> list[int]` (a Hugging Face one: `lambda text: tok.encode(text,
    add_special_tokens=False)`). Byte-level BPE gives a word another id after a space, and case matters, so a
    phrase matches as written, lower-case or capitalised, each with and without a leading space."""

    PROBE = "The quick brown fox, 1903: Marie Curie's Nobel Prize."

    def __init__(self, encode_fn: Callable[[str], list[int]]) -> None:
        self.encode_fn = encode_fn

    def encode(self, text: str) -> list[int]:
        return [int(token) for token in self.encode_fn(text)]

    def fingerprint(self) -> list[int]:
        return self.encode(self.PROBE)

    def variants(self, phrase: str) -> list[list[int]]:
        phrase = " ".join(phrase.split())
        if not phrase:
            return []
        forms = dict.fromkeys([phrase, phrase.lower(), phrase[:1].upper() + phrase[1:]])
        variants = []
        for form in forms:
            for text in (form, " " + form):
                ids = self.encode(text)
                if ids and ids not in variants:
                    variants.append(ids)
        return variants


class CooccurrenceCounter(ABC):
    """count_cooccurrence over a subclass's `_clause(variants)` and `document_starts` ([D] int64, each document's
    separator position), with an LRU cache of clauses bounded in positions and entries (G completions repeat words)."""

    CACHE_ENTRIES = 65_536
    document_starts: np.ndarray

    def __init__(self, tokenizer: WordTokenizer | ExternalTokenizer, *, cache_positions: int = 4_000_000,
                 semantics: str = "engine") -> None:
        self.tokenizer = tokenizer
        self.semantics = semantics
        # A clause costs its positions plus its share of CACHE_ENTRIES, so both bounds hold together.
        entry_cost = max(1, cache_positions // self.CACHE_ENTRIES)
        self._cache = LRUCache(cache_positions, getsizeof=lambda clause: len(clause.positions) + entry_cost)

    @abstractmethod
    def _clause(self, variants: list[list[int]]) -> Clause:
        """The Clause of the union of the token-id variants of one phrase."""

    def clause(self, phrase: str) -> Clause | None:
        """Positions of one phrase (None when a word is unknown)."""
        variants = self.tokenizer.variants(phrase)
        if not variants:
            return None
        key = tuple(tuple(ids) for ids in variants)
        clause = self._cache.get(key)
        if clause is None:
            clause = self._clause(variants)
            with contextlib.suppress(ValueError):  # a clause larger than the whole cache is not kept
                self._cache[key] = clause
        return clause

    def count_cooccurrence(self, head_words: Sequence[str], tail_words: Sequence[str], window: int = 1000, *,
                           semantics: str | None = None) -> int:
        """How often the head phrases and the tail phrases co-occur within `window` tokens (module docstring)."""
        if isinstance(head_words, str) or isinstance(tail_words, str):
            raise ValueError("head_words and tail_words must be lists of phrases, not strings")
        if not head_words or not tail_words:
            raise ValueError(f"need at least one head and one tail phrase, got {list(head_words)} and "
                             f"{list(tail_words)}")
        if window < 0:
            raise ValueError(f"window must be >= 0 tokens, got {window}")
        clauses = []
        for phrase in [*head_words, *tail_words]:
            clause = self.clause(phrase)
            if clause is None or len(clause.positions) == 0:
                return 0
            clauses.append(clause)
        if (semantics or self.semantics) == "document":
            return document_window_count(clauses, window)
        return engine_window_count(clauses, window, self.document_starts)
