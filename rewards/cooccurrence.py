"""What a co-occurrence count is, independent of where the token positions come from.

count_cooccurrence(head_words, tail_words, window) = the number of occurrences of the rarest query phrase
that have every other query phrase starting within `window` tokens of them in the SAME document. Each
element of head_words/tail_words is one phrase (an AND term); a phrase matches where any of its token
variants does (an OR, e.g. with and without a leading space for byte-level BPE); a phrase holding a word
the tokenizer does not know makes the count 0. The corpus index (rewards/corpus.py) gets the positions
from infini-gram; MemoryCounter here gets them from a token array, for tests and small corpora.

Why not infini-gram's own `count_cnf(..., max_diff_tokens=window)`: it drops an occurrence whenever the
nearest partner on one side sits in a neighbouring document, even if a partner in the same document is
close on the other side; on SciFact abstracts (~225 tokens) with a 1000-token window that undercounts
"cells AND patients" as 221 instead of 631. Here both sides are checked separately.
"""
from __future__ import annotations

import re
import unicodedata
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

Clause = tuple[np.ndarray, np.ndarray, float]  # (sorted start positions, document index of each, scale)
_WORD = re.compile(r"[^\W_]+")


def window_count(clauses: Sequence[Clause], window: int) -> int:
    """Occurrences of the rarest clause with every other clause within `window` tokens in the same document.

    clauses: per phrase, (positions [N] int64 sorted, documents [N] int64, scale): scale > 1 when the
    positions are a subsample (the count is scaled back by the anchor's scale, as infini-gram does).
    For each anchor only the nearest partner on each side needs checking: a farther one on that side is
    farther away and, documents being contiguous, not in a nearer document.
    """
    order = sorted(range(len(clauses)), key=lambda index: len(clauses[index][0]) * clauses[index][2])
    anchor_positions, anchor_documents, anchor_scale = clauses[order[0]]
    keep = np.ones(len(anchor_positions), dtype=bool)
    for index in order[1:]:
        positions, documents, _ = clauses[index]
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


class WordTokenizer:
    """Word-level tokenizer fitted on the corpus: NFKC, lower-case, words are runs of letters/digits
    (`[^\\W_]+`), ids 1.. by descending frequency. Id 0 is reserved (the engine wants an end-of-document
    id) and the index stores 16-bit tokens with 0xFFFF as the document separator, so at most MAX_WORDS
    words get an id; rarer words share UNKNOWN_ID in the token stream (keeping positions exact) and a
    query holding one is unknown, count 0, like a word the corpus never contains. Needs no download."""

    kind = "word"
    MAX_WORDS = 2**16 - 3
    UNKNOWN_ID = 2**16 - 2

    def __init__(self, vocabulary: Sequence[str]) -> None:
        if len(vocabulary) > self.MAX_WORDS:
            raise ValueError(f"a word vocabulary holds at most {self.MAX_WORDS} words, got {len(vocabulary)}")
        self.vocabulary = list(vocabulary)
        self.ids = {word: index + 1 for index, word in enumerate(self.vocabulary)}

    @staticmethod
    def words(text: str) -> list[str]:
        return _WORD.findall(unicodedata.normalize("NFKC", text).lower())

    @classmethod
    def fit(cls, texts: Iterable[str], max_words: int = MAX_WORDS) -> WordTokenizer:
        counts: dict[str, int] = {}
        for text in texts:
            for word in cls.words(text):
                counts[word] = counts.get(word, 0) + 1
        return cls(sorted(counts, key=lambda word: (-counts[word], word))[:max_words])

    def encode(self, text: str) -> list[int]:
        """Ids of every word, UNKNOWN_ID for a word outside the vocabulary."""
        return [self.ids.get(word, self.UNKNOWN_ID) for word in self.words(text)]

    def variants(self, phrase: str) -> list[list[int]]:
        """[ids] of the phrase, or [] when a word is unknown or there is no word (neither can occur)."""
        words = self.words(phrase)
        if not words:
            return []
        ids = [self.ids.get(word) for word in words]
        return [] if None in ids else [ids]


class ExternalTokenizer:
    """Any tokenizer given as `encode_fn(text) -> list[int]` (e.g. the policy's; wrap a Hugging Face one as
    `lambda text: tok.encode(text, add_special_tokens=False)`). Byte-level BPE gives a word a different id
    with a leading space, and case matters, so a phrase matches any of: as written, lower-case,
    capitalised, each with and without a leading space."""

    kind = "external"
    PROBE = "The quick brown fox, 1903: Marie Curie's Nobel Prize."

    def __init__(self, encode_fn: Callable[[str], list[int]], name: str = "external") -> None:
        self.encode_fn = encode_fn
        self.name = name

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
    """count_cooccurrence over `_clause(variants) -> (positions, documents, scale)`, with an LRU cache of
    clauses (the G completions of one prompt repeat the same words) bounded by the positions it holds
    and by its number of entries."""

    CACHE_ENTRIES = 65_536

    def __init__(self, tokenizer: WordTokenizer | ExternalTokenizer, *, cache_positions: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple, Clause] = OrderedDict()
        self._cached_positions = 0
        self._cache_limit = cache_positions

    @abstractmethod
    def _clause(self, variants: list[list[int]]) -> Clause:
        """(positions, documents, scale) of the union of the token-id variants of one phrase."""

    def clause(self, phrase: str) -> Clause | None:
        """Positions of one phrase (None when a word is unknown)."""
        variants = self.tokenizer.variants(phrase)
        if not variants:
            return None
        key = tuple(tuple(ids) for ids in variants)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        clause = self._clause(variants)
        if len(clause[0]) <= self._cache_limit:
            self._cache[key] = clause
            self._cached_positions += len(clause[0])
            while self._cached_positions > self._cache_limit or len(self._cache) > self.CACHE_ENTRIES:
                _, evicted = self._cache.popitem(last=False)
                self._cached_positions -= len(evicted[0])
        return clause

    def count_cooccurrence(self, head_words: Sequence[str], tail_words: Sequence[str], window: int = 1000) -> int:
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
            if clause is None or len(clause[0]) == 0:
                return 0
            clauses.append(clause)
        return window_count(clauses, window)


class MemoryCounter(CooccurrenceCounter):
    """The same counts from an in-memory token array (tests, small corpora): documents laid out as in the
    index, each preceded by one separator token (-1), so positions and windows agree with CorpusIndex.

    >>> counter = MemoryCounter(["Marie Curie won the Nobel Prize.", "Paris is in France.", "Curie, Nobel."])
    >>> counter.count_cooccurrence(["Marie Curie"], ["Nobel"]), counter.count_cooccurrence(["Curie"], ["Nobel"])
    (1, 2)
    >>> counter.count_cooccurrence(["Curie"], ["France"]), counter.count_cooccurrence(["zebra"], ["Nobel"])
    (0, 0)
    """

    def __init__(self, texts: Iterable[str], *, tokenizer: WordTokenizer | ExternalTokenizer | None = None) -> None:
        texts = list(texts)
        super().__init__(tokenizer if tokenizer is not None else WordTokenizer.fit(texts))
        pieces, starts, length = [], [], 0
        for text in texts:
            ids = [-1, *self.tokenizer.encode(text)]
            starts.append(length)
            pieces.append(np.asarray(ids, dtype=np.int64))
            length += len(ids)
        self.tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        self.document_starts = np.asarray(starts, dtype=np.int64)
        order = np.argsort(self.tokens, kind="stable")  # positions grouped by id, ascending within an id
        unique_ids, firsts = np.unique(self.tokens[order], return_index=True)
        ends = np.append(firsts[1:], len(order))
        self._positions_by_id = {int(token): order[first:end]
                                 for token, first, end in zip(unique_ids, firsts, ends)}

    def _clause(self, variants: list[list[int]]) -> Clause:
        found = []
        for ids in variants:
            candidates = self._positions_by_id.get(ids[0], np.zeros(0, dtype=np.int64))
            for offset, token in enumerate(ids[1:], start=1):
                candidates = candidates[candidates + offset < len(self.tokens)]
                candidates = candidates[self.tokens[candidates + offset] == token]
            found.append(candidates)
        positions = np.unique(np.concatenate(found)).astype(np.int64)
        documents = np.searchsorted(self.document_starts, positions, side="right") - 1
        return positions, documents, 1.0
