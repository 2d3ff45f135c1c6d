"""A local corpus index on infini-gram's suffix array: a jsonl corpus tokenised into its files, then queried.

    python -m rewards.corpus build --input corpus.jsonl --out DIR      # one {"text": ...} object per line
    python -m rewards.corpus count --index DIR --head "Marie Curie" --tail "Nobel Prize"

The directory holds infini-gram's v4 files (tokenized.0, offset.0, table.0), vocab.txt (one word per line,
id = line number) and nanogrpo-index.json (sizes, tokenizer), written last. The tokenizer is rewards.cooccurrence's.

The token stream is 16-bit (docs/recipes.md, "Corpus counts", says why); ids that do not fit one token take two:

    "u16"    every id is one token (ids 0..MAX_SINGLE_ID); one separator token 0xFFFF per document.
    "u16x2"  every id v is the pair (1 + v // LOW_IDS, HIGH_IDS + 1 + v % LOW_IDS): first tokens lie in
             [1, HIGH_IDS], second ones above, so a phrase's pattern matches only at the start of a pair; two
             separator tokens per document, so every position is exactly twice its "u16" one.

No token has 0xFF as its high byte, so the engine's byte-level search for the separator finds real ones only."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from data.jsonio import iter_jsonl
from rewards.cooccurrence import SEMANTICS, Clause, CooccurrenceCounter, ExternalTokenizer, WordTokenizer

META_FILE, VOCAB_FILE = "nanogrpo-index.json", "vocab.txt"
FORMAT, VERSION = "nanogrpo-corpus-index", 2  # version 1: the "u16" layout, rare words capped
_ENGINE_NAME_PARTS = ("tokenized", "table", "offset", "metadata", "metaoff")
_ONE_CPU_BELOW_BYTES = 16 * 2**20  # infini-gram's builder panics with several jobs on a smaller corpus
TOKEN_WIDTH = 2  # bytes per stored token
SEPARATOR_ID = 0xFFFF
MAX_SINGLE_ID = 0xFEFF
HIGH_IDS = 32_639
LOW_IDS = MAX_SINGLE_ID - HIGH_IDS  # 32,640
MAX_PAIR_ID = HIGH_IDS * LOW_IDS - 1  # 1,065,336,959
TOKENS_PER_ID = {"u16": 1, "u16x2": 2}
# The bytes that open every document in the token stream, per layout.
SEPARATORS = {layout: np.full(n, SEPARATOR_ID, dtype=np.uint16).tobytes() for layout, n in TOKENS_PER_ID.items()}


def choose_layout(largest_id: int, where: str = "the corpus") -> str:
    """"u16" when `largest_id` fits one token, else "u16x2"; ValueError naming the id beyond MAX_PAIR_ID."""
    if largest_id <= MAX_SINGLE_ID:
        return "u16"
    if largest_id <= MAX_PAIR_ID:
        return "u16x2"
    raise ValueError(f"{where} has token id {largest_id:,}, beyond the largest id the index stores, {MAX_PAIR_ID:,} "
                     f"(two 16-bit tokens per id)")


def stored_tokens(ids: np.ndarray, layout: str) -> np.ndarray:
    """[N] int ids (0..MAX_PAIR_ID, or 0..MAX_SINGLE_ID for "u16") -> [N * TOKENS_PER_ID[layout]] uint16.

    >>> stored_tokens(np.array([5, 32_640, 70_000]), "u16x2").tolist()
    [1, 32645, 2, 32640, 3, 37360]
    """
    ids = np.asarray(ids, dtype=np.int64)
    if layout == "u16":
        return ids.astype(np.uint16)
    pairs = np.stack([1 + ids // LOW_IDS, HIGH_IDS + 1 + ids % LOW_IDS], axis=1)
    return pairs.reshape(-1).astype(np.uint16)


def _engine_safe(path: Path) -> bool:
    return not any(part in str(path.resolve()) for part in _ENGINE_NAME_PARTS)


@contextlib.contextmanager
def _engine_dir(path: Path) -> Iterator[Path]:
    """The absolute index directory to hand infini-gram (its builder chdirs), or, when that full path holds one of
    _ENGINE_NAME_PARTS (infini-gram sorts its files by those substrings), a symlink to it in a temporary directory
    removed on leaving (the engine maps its files on opening)."""
    if _engine_safe(path):
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="nanogrpo-index-") as link_parent:
        if not _engine_safe(Path(link_parent)):
            raise ValueError(f"temporary directory {link_parent} contains one of {_ENGINE_NAME_PARTS}; set TMPDIR "
                             "elsewhere")
        (Path(link_parent) / "index").symlink_to(path.resolve(), target_is_directory=True)
        yield Path(link_parent) / "index"


def read_texts(input_path: Path, text_field: str = "text") -> Iterator[str]:
    """The `text_field` string of every non-blank line; ValueError naming the file and line otherwise (also for a
    file without a record: data.jsonio.iter_jsonl's checks)."""
    for line_number, record in iter_jsonl(input_path):
        if not isinstance(record.get(text_field), str):
            raise ValueError(f"{input_path}:{line_number}: expected an object with a string field {text_field!r}")
        yield record[text_field]


def _run_builder(work_dir: Path, data_bytes: int, cpus: int | None) -> None:
    """infini-gram's suffix-array builder on work_dir/tokenized.0 -> work_dir/table.0."""
    from infini_gram import indexing  # imported here: only building needs it

    if cpus is None:
        cpus = 1 if data_bytes < _ONE_CPU_BELOW_BYTES else min(os.cpu_count() or 1, 8)
    memory_gib = max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30 // 2)
    arguments = argparse.Namespace(save_dir=str(work_dir), temp_dir=str(work_dir), cpus=cpus, mem=memory_gib,
                                   shards=1, workers=1, worker_id=0, token_width=TOKEN_WIDTH)
    working_directory, captured = os.getcwd(), io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            indexing.build_sa(arguments)
    except SystemExit:  # the builder reports a failed Rust step with exit(1)
        raise RuntimeError(f"infini-gram's suffix-array builder failed in {work_dir}:\n"
                           f"{captured.getvalue()[-2000:]}") from None
    finally:
        os.chdir(working_directory)  # the builder chdirs into its save_dir
    if not (work_dir / "table.0").exists():
        raise RuntimeError(f"infini-gram's builder wrote no table.0 in {work_dir}:\n{captured.getvalue()[-2000:]}")


def _encode_corpus(input_path: Path, text_field: str, tokenizer: WordTokenizer | ExternalTokenizer,
                   ids_path: Path) -> tuple[np.ndarray, int]:
    """Pass 1: every document's ids into ids_path (uint32); returns (ids per document, largest id)."""
    lengths, largest = [], 0
    with open(ids_path, "wb") as handle:
        for text in read_texts(input_path, text_field):
            ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
            if len(ids) and ids.min() < 0:
                raise ValueError(f"{input_path}: document {len(lengths)} has a negative token id {ids.min()}")
            largest = max(largest, int(ids.max()) if len(ids) else 0)
            handle.write(ids.astype(np.uint32).tobytes())
            lengths.append(len(ids))
    return np.asarray(lengths, dtype=np.int64), largest


def _write_tokens(ids_path: Path, lengths: np.ndarray, layout: str, work_dir: Path) -> int:
    """Pass 2, infini-gram's v4 layout: tokenized.0 = per document the separator then its stored tokens;
    offset.0 = the uint64 byte offset of each document. Returns the bytes of tokenized.0."""
    ids = np.memmap(ids_path, dtype=np.uint32, mode="r") if lengths.sum() else np.zeros(0, dtype=np.uint32)
    opening, data_bytes, start = SEPARATORS[layout], 0, 0
    with open(work_dir / "tokenized.0", "wb") as data, open(work_dir / "offset.0", "wb") as offsets:
        for length in lengths:
            offsets.write(np.uint64(data_bytes).tobytes())
            payload = opening + stored_tokens(ids[start:start + length], layout).tobytes()
            data.write(payload)
            data_bytes += len(payload)
            start += length
    return data_bytes


def build_index(input_path: str | os.PathLike, out_dir: str | os.PathLike, *, text_field: str = "text",
                encode_fn: Callable[[str], list[int]] | None = None, tokenizer_name: str = "external",
                cpus: int | None = None) -> Path:
    """Build a corpus index from a jsonl file into out_dir (created, or empty) and return its path. encode_fn:
    None for the WordTokenizer fitted on the corpus, else any tokenizer's encode (ids >= 0)."""
    input_path, out_dir = Path(input_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"index directory {out_dir} exists and is not empty; choose a new --out")
    if encode_fn is None:
        tokenizer: WordTokenizer | ExternalTokenizer = WordTokenizer.fit(read_texts(input_path, text_field))
    else:
        tokenizer = ExternalTokenizer(encode_fn)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lengths, largest = _encode_corpus(input_path, text_field, tokenizer, out_dir / "ids.tmp")
        layout = choose_layout(largest, str(input_path))
        data_bytes = _write_tokens(out_dir / "ids.tmp", lengths, layout, out_dir)
        (out_dir / "ids.tmp").unlink()
        with _engine_dir(out_dir) as engine_dir:
            _run_builder(engine_dir, data_bytes, cpus)
        tokens = data_bytes // TOKEN_WIDTH
        pointer_bytes = (out_dir / "table.0").stat().st_size // tokens
    except BaseException:  # leave no half-built index behind (out_dir was absent or empty)
        shutil.rmtree(out_dir, ignore_errors=True)
        if not created:
            out_dir.mkdir()
        raise
    if isinstance(tokenizer, WordTokenizer):
        (out_dir / VOCAB_FILE).write_text("".join(word + "\n" for word in tokenizer.vocabulary), encoding="utf-8")
        tokenizer_meta: dict = {"kind": "word", "words": len(tokenizer.vocabulary)}
    else:
        tokenizer_meta = {"kind": "external", "name": tokenizer_name, "fingerprint": tokenizer.fingerprint()}
    meta = {"format": FORMAT, "version": VERSION, "source": str(input_path), "text_field": text_field,
            "token_dtype": "u16", "layout": layout, "documents": len(lengths), "tokens": tokens,
            "data_bytes": data_bytes, "pointer_bytes": pointer_bytes, "tokenizer": tokenizer_meta}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return out_dir


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
        if meta["layout"] not in TOKENS_PER_ID:  # each layout stores 16-bit tokens
            raise ValueError(f"layout {meta['layout']!r} is not one of {list(TOKENS_PER_ID)}")
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
        opening = SEPARATORS[meta["layout"]]
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
    encode_fn: required for an index built with one, checked against its stored fingerprint. A phrase with more
    than max_clause_freq occurrences (the engine's default) is subsampled and its count scaled back, as the engine's."""

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
            tokenizer = ExternalTokenizer(encode_fn)
            if tokenizer.fingerprint() != meta["tokenizer"].get("fingerprint"):
                raise ValueError(f"corpus index {path}: encode_fn is not the tokenizer the index was built with")
        super().__init__(tokenizer, cache_positions=cache_positions, semantics=semantics)
        from infini_gram.engine import InfiniGramEngine  # imported here: `import rewards` stays light

        self.path, self.meta, self.max_clause_freq = path, meta, max_clause_freq
        self.layout, self.stride = meta["layout"], TOKENS_PER_ID[meta["layout"]]
        with _engine_dir(path) as engine_dir:
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
    build.add_argument("--cpus", type=int, default=None, help="suffix-array builder jobs (default: by corpus size)")
    count = commands.add_parser("count", help="count a head/tail co-occurrence in an index")
    count.add_argument("--index", required=True)
    count.add_argument("--head", required=True, action="append", help="head phrase (repeatable)")
    count.add_argument("--tail", required=True, action="append", help="tail phrase (repeatable)")
    count.add_argument("--window", type=int, default=1000)
    count.add_argument("--semantics", choices=SEMANTICS, default="engine", help="see rewards.cooccurrence")
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
    main()
