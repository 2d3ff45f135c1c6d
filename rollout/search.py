"""The `search` tool: BM25 (the bm25s library) over the sentences of a SciFact-style corpus, so a model can look for
its evidence instead of being handed the abstract (launch/configs/veriseek_search.yaml).

Every abstract sentence is one entry of the index, returned with its doc_id and its sentence number (as SciFact's
rationales count them). `python -m data.scifact --search` builds the index beside the rows it writes;
rollout.search_index names the index a run searches."""
from __future__ import annotations

import functools
import os
import sys

from data.scifact import load_corpus

INDEX_ENV = "NANOGRPO_SEARCH_INDEX"  # set from rollout.search_index (launch/build.py), read by `search`
TOP_K = 3  # sentences per search: each costs context tokens in every later turn


def _bm25s():
    """bm25s on its numpy path: its optional numba backend would import llvmlite, and vLLM's CPU start-up then
    fails in this process (its kernel scan reads an attribute llvmlite fakes); one query needs no JIT."""
    hidden = sys.modules.setdefault("numba", None) is None  # a None entry makes `import numba` raise ImportError
    try:
        import bm25s
    finally:
        if hidden:
            del sys.modules["numba"]
    return bm25s


def build_index(corpus_path: str | os.PathLike, out: str | os.PathLike) -> int:
    """Index every abstract sentence of corpus.jsonl ({"doc_id", "title", "abstract": [sentence, ...]}) into `out`;
    returns the number of sentences."""
    bm25s = _bm25s()
    entries = [{"doc_id": doc_id, "sentence": number, "text": " ".join(text.split())}
               for doc_id, document in load_corpus(corpus_path).items()
               for number, text in enumerate(document["abstract"])]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([entry["text"] for entry in entries], stopwords="en", show_progress=False),
                    show_progress=False)
    retriever.save(str(out), corpus=entries)
    return len(entries)


@functools.cache
def load_index(path: str):
    """The bm25s retriever saved in `path`, loaded once per process (FileNotFoundError naming a missing file)."""
    return _bm25s().BM25.load(path, load_corpus=True)


def top_sentences(index: str, query: str) -> str:
    """The TOP_K sentences of index directory `index` that best match `query`: `[doc D, sentence S] text` lines."""
    tokens = _bm25s().tokenize([query], stopwords="en", show_progress=False)
    if not tokens.vocab:
        return "no results: the query has no searchable words"
    results, _ = load_index(index).retrieve(tokens, k=TOP_K, show_progress=False)
    return "\n".join(f"[doc {hit['doc_id']}, sentence {hit['sentence']}] {hit['text']}" for hit in results[0])


def search(query: str) -> str:
    """Search the scientific corpus for the sentences that best match a query.

    Args:
        query: what to look for, in a few words or the claim itself.
    """
    return top_sentences(os.environ.get(INDEX_ENV, ""), query)
