"""An in-memory co-occurrence counter for the tests: the counts of rewards.cooccurrence (both window
definitions) from a token array instead of an infini-gram index, a reference the index is checked against."""
from collections.abc import Iterable

import numpy as np

from rewards.cooccurrence import Clause, CooccurrenceCounter, ExternalTokenizer, WordTokenizer


class MemoryCounter(CooccurrenceCounter):
    """The same counts from an in-memory token array: documents laid out as in the index, each preceded by one
    separator token (-1), so positions and windows agree with rewards.corpus.CorpusIndex."""

    def __init__(self, texts: Iterable[str], *, tokenizer: WordTokenizer | ExternalTokenizer | None = None,
                 semantics: str = "engine") -> None:
        texts = list(texts)
        super().__init__(tokenizer if tokenizer is not None else WordTokenizer.fit(texts), semantics=semantics)
        encoded = [[-1, *self.tokenizer.encode(text)] for text in texts]
        self.tokens = np.asarray([token for ids in encoded for token in ids], dtype=np.int64)
        self.document_starts = np.cumsum([0, *(len(ids) for ids in encoded)])[:-1].astype(np.int64)
        order = np.argsort(self.tokens, kind="stable")  # positions grouped by id, ascending within an id
        unique_ids, firsts = np.unique(self.tokens[order], return_index=True)
        ends = np.append(firsts[1:], len(order))
        self._positions_by_id = {int(token): order[first:end] for token, first, end in zip(unique_ids, firsts, ends)}

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
        return Clause(positions, documents, 1.0, len(positions))
