"""A local corpus index on infini-gram's suffix array: built by rewards/index_build.py, queried here.

    python -m rewards.corpus build --input corpus.jsonl --out DIR      # one {"text": ...} object per line
    python -m rewards.corpus count --index DIR --head "Marie Curie" --tail "Nobel Prize"

The directory holds infini-gram's v4 files (tokenized.0, offset.0, table.0), vocab.txt (one word per line,
id = line number) and nanogrpo-index.json (sizes, tokenizer), written last. The tokenizer is ours
(rewards.cooccurrence); the engine finds each phrase's occurrences. It checks none of its files, so they are
checked here, and a path holding a name it sorts its files by is opened through a neutral symlink.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rewards.cooccurrence import Clause, CooccurrenceCounter, ExternalTokenizer, WordTokenizer
from rewards.index_build import (_ENGINE_NAME_PARTS, FORMAT, MAX_PAIR_ID, MAX_SINGLE_ID, META_FILE, TOKEN_WIDTH,
                                 TOKENS_PER_ID, VERSION, VOCAB_FILE, _engine_safe, build_index, separator,
                                 stored_tokens)


def check_index(path: Path) -> dict:
    """The index's metadata, after checking every file against it (the engine itself checks nothing)."""
    fix = f"; build it with: python -m rewards.corpus build --input corpus.jsonl --out {path}"
    if not path.is_dir():
        raise FileNotFoundError(f"corpus index directory {path} does not exist{fix}")
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"corpus index {path}: cannot read {META_FILE} ({error}){fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION):
        raise ValueError(f"corpus index {path}: {META_FILE} is not a {FORMAT} version 1 or {VERSION} file{fix}")
    try:
        meta.setdefault("layout", "u16")  # version 1 had only this layout
        if meta["token_dtype"] != "u16" or meta["layout"] not in TOKENS_PER_ID:
            raise ValueError(f"token_dtype {meta['token_dtype']!r} / layout {meta['layout']!r} is not u16 / "
                             f"one of {list(TOKENS_PER_ID)}")
        tokens, data_bytes, documents, pointer_bytes = (
            int(meta[key]) for key in ("tokens", "data_bytes", "documents", "pointer_bytes"))
        expected = {"tokenized.0": data_bytes, "offset.0": 8 * documents, "table.0": tokens * pointer_bytes}
        for name, size in expected.items():
            if not (path / name).is_file() or (path / name).stat().st_size != size:
                raise ValueError(f"{name} is missing or not {size} bytes")
        if tokens * TOKEN_WIDTH != data_bytes or not 1 <= pointer_bytes <= 8 or documents < 1:
            raise ValueError("sizes in the metadata disagree")
        offsets = np.fromfile(path / "offset.0", dtype=np.uint64).astype(np.int64)
        if offsets[0] != 0 or np.any(np.diff(offsets) < TOKEN_WIDTH) or offsets[-1] >= data_bytes:
            raise ValueError("offset.0 is not increasing document starts")
        data = np.memmap(path / "tokenized.0", dtype=np.uint8, mode="r")
        sample = np.linspace(0, documents - 1, num=min(documents, 1024)).astype(np.int64)
        opening = separator(meta["layout"])
        if not all(bytes(data[offsets[index]:offsets[index] + len(opening)]) == opening for index in sample):
            raise ValueError("offset.0 does not point at document separators in tokenized.0")
        table = np.memmap(path / "table.0", dtype=np.uint8, mode="r").reshape(tokens, pointer_bytes)
        rows = table[np.linspace(0, tokens - 1, num=min(tokens, 1024)).astype(np.int64)].astype(np.int64)
        pointers = (rows << (8 * np.arange(pointer_bytes))).sum(axis=1)
        if np.any(pointers >= data_bytes) or np.any(pointers % TOKEN_WIDTH):
            raise ValueError("table.0 holds pointers outside tokenized.0")
        if meta["tokenizer"]["kind"] == "word":
            lines = (path / VOCAB_FILE).read_text(encoding="utf-8").split("\n")[:-1]
            if len(lines) != int(meta["tokenizer"]["words"]):
                raise ValueError(f"{VOCAB_FILE} has {len(lines)} words, expected {meta['tokenizer']['words']}")
            meta["vocabulary"] = lines
    except KeyError as error:
        raise ValueError(f"corpus index {path} is corrupt: {META_FILE} lacks the key {error}{fix}") from None
    except (TypeError, ValueError, OSError) as error:
        raise ValueError(f"corpus index {path} is corrupt: {error}{fix}") from None
    return meta


class CorpusIndex(CooccurrenceCounter):
    """Co-occurrence counts (rewards.cooccurrence) on a built index, positions in ids whatever the layout.

    encode_fn: required for an index built with one, checked against the fingerprint stored then.
    max_clause_freq: a phrase with more occurrences is subsampled by infini-gram and its count scaled back,
    as infini-gram's own counts are (the default is the engine's).
    """

    def __init__(self, path: str | os.PathLike, *, encode_fn: Callable[[str], list[int]] | None = None,
                 max_clause_freq: int = 50_000, cache_positions: int = 4_000_000, semantics: str = "engine") -> None:
        path = Path(path)
        meta = check_index(path)
        if meta["tokenizer"]["kind"] == "word":
            tokenizer: WordTokenizer | ExternalTokenizer = WordTokenizer(meta.pop("vocabulary"))
        else:
            if encode_fn is None:
                raise ValueError(f"corpus index {path} was built with tokenizer "
                                 f"{meta['tokenizer'].get('name')!r}: pass its encode_fn")
            tokenizer = ExternalTokenizer(encode_fn, meta["tokenizer"].get("name", "external"))
            if tokenizer.fingerprint() != meta["tokenizer"].get("fingerprint"):
                raise ValueError(f"corpus index {path}: encode_fn is not the tokenizer the index was built with")
        super().__init__(tokenizer, cache_positions=cache_positions, semantics=semantics)
        from infini_gram.engine import InfiniGramEngine  # imported here: `import rewards` stays light

        self.path, self.meta, self.max_clause_freq = path, meta, max_clause_freq
        self.layout, self.stride = meta["layout"], TOKENS_PER_ID[meta["layout"]]
        engine_dir = path
        if not _engine_safe(path):
            link_parent = Path(tempfile.mkdtemp(prefix="nanogrpo-index-"))
            weakref.finalize(self, shutil.rmtree, link_parent, ignore_errors=True)
            engine_dir = link_parent / "index"
            engine_dir.symlink_to(path.resolve(), target_is_directory=True)
            if not _engine_safe(link_parent):
                raise ValueError(f"temporary directory {link_parent} contains one of {_ENGINE_NAME_PARTS}; "
                                 "set TMPDIR elsewhere")
        self.engine = InfiniGramEngine(index_dir=str(engine_dir), eos_token_id=0, version=4, token_dtype="u16")
        offsets = np.fromfile(path / "offset.0", dtype=np.uint64).astype(np.int64)
        self.document_starts = offsets // (TOKEN_WIDTH * self.stride)

    def stored(self, variants: list[list[int]]) -> list[list[int]]:
        """The engine's token pattern of each variant the layout can hold (another never occurs)."""
        largest = MAX_SINGLE_ID if self.layout == "u16" else MAX_PAIR_ID
        return [stored_tokens(np.asarray(ids), self.layout).tolist() for ids in variants
                if min(ids) >= 0 and max(ids) <= largest]

    def _clause(self, variants: list[list[int]]) -> Clause:
        patterns = self.stored(variants)
        total = sum(self.engine.count(input_ids=pattern)["count"] for pattern in patterns)
        if total == 0:
            empty = np.zeros(0, dtype=np.int64)
            return Clause(empty, empty, 1.0, 0)
        result = self.engine.find_cnf([patterns], max_clause_freq=self.max_clause_freq, max_diff_tokens=1)
        if "error" in result:
            raise RuntimeError(f"infini-gram query on {self.path} failed: {result['error']}")
        pointers = np.asarray(result["ptrs_by_shard"][0], dtype=np.int64)
        positions = np.unique(pointers // (TOKEN_WIDTH * self.stride))
        documents = np.searchsorted(self.document_starts, positions, side="right") - 1
        # the engine's subsampling factor: an integer ratio (U64 division), 1 when nothing was dropped
        scale = float(total // len(pointers)) if total > self.max_clause_freq else 1.0
        return Clause(positions, documents, scale, total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rewards.corpus", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build an index from a jsonl corpus with a text field")
    build.add_argument("--input", required=True, help="jsonl file, one object with a string text field per line")
    build.add_argument("--out", required=True, help="new (or empty) index directory")
    build.add_argument("--text-field", default="text")
    build.add_argument("--cpus", type=int, default=None,
                       help="suffix-array builder jobs (default: 1 below 16 MiB of tokens, else up to 8)")
    count = commands.add_parser("count", help="count a head/tail co-occurrence in an index")
    count.add_argument("--index", required=True)
    count.add_argument("--head", required=True, action="append", help="head phrase (repeatable)")
    count.add_argument("--tail", required=True, action="append", help="tail phrase (repeatable)")
    count.add_argument("--window", type=int, default=1000)
    count.add_argument("--semantics", choices=("engine", "document"), default="engine",
                       help="window definition (rewards.cooccurrence): infini-gram's count_cnf, or per document")
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "build":
            out = build_index(arguments.input, arguments.out, text_field=arguments.text_field, cpus=arguments.cpus)
            meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
            print(f"built {out}: {meta['documents']} documents, {meta['tokens']} tokens, "
                  f"{meta['tokenizer']['words']} words, layout {meta['layout']}")
        else:
            index = CorpusIndex(arguments.index)
            print(index.count_cooccurrence(arguments.head, arguments.tail, arguments.window,
                                           semantics=arguments.semantics))
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
