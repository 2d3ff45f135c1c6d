"""The infini-gram corpus index: built from SciFact in the suite, its counts checked against infini-gram's own
count_cnf, a brute-force count and the in-memory counter; a corpus of more than 65,534 distinct words counts
exactly (two tokens per id); plus the engine quirks (path names, tiny corpora, cwd), corrupt indexes and the CLI."""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from bench.cooccurrence import engine_count
from memory_counter import MemoryCounter
from rewards import compute_score
from rewards.cooccurrence import ExternalTokenizer
from rewards.corpus import MAX_PAIR_ID, MAX_SINGLE_ID, CorpusIndex, build_index, choose_layout
from rewards.factqa import count_reward

ROOT = Path(__file__).resolve().parents[1]
TINY = ["Marie Curie won the Nobel Prize in Physics.", "Paris is the capital of France.",
        "Curie lived in Paris for years.", "Paris, France. Nobel laureates."]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def scifact_texts(shared_data) -> list[str]:
    texts = []
    with open(shared_data / "scifact" / "corpus.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            texts.append(record["title"] + "\n" + " ".join(record["abstract"]))
    assert len(texts) == 5183
    return texts


@pytest.fixture(scope="module")
def scifact_words(scifact_texts) -> list[list[str]]:
    return [re.findall(r"[^\W_]+", text.lower()) for text in scifact_texts]


@pytest.fixture(scope="module")
def scifact_index(scifact_texts, tmp_path_factory) -> CorpusIndex:
    directory = tmp_path_factory.mktemp("scifact")
    build_index(write_jsonl(directory / "corpus.jsonl", scifact_texts), directory / "index")
    return CorpusIndex(directory / "index")


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    return build_index(write_jsonl(directory / "corpus.jsonl", TINY), directory / "index")


def brute_force_count(documents: list[list[str]], head: str, tail: str, window: int) -> int:
    """Plain loops: occurrences of the rarer phrase with the other within `window` words in the same document."""

    def starts(words: list[str], phrase: list[str]) -> list[int]:
        return [index for index, word in enumerate(words)
                if word == phrase[0] and words[index:index + len(phrase)] == phrase]

    head_words, tail_words = head.lower().split(), tail.lower().split()
    head_starts = [starts(words, head_words) for words in documents]
    tail_starts = [starts(words, tail_words) for words in documents]
    if sum(map(len, tail_starts)) < sum(map(len, head_starts)):
        head_starts, tail_starts = tail_starts, head_starts
    return sum(1 for anchors, partners in zip(head_starts, tail_starts)
               for anchor in anchors if any(abs(anchor - partner) <= window for partner in partners))


@pytest.mark.parametrize("head, tail, reward", [
    ("insulin", "diabetes", 0.1),           # co-occur in many abstracts (engine 232, per document 266)
    ("Alzheimer", "amyloid", 0.1),
    ("type 2 diabetes", "insulin", 0.1),    # a phrase
    ("tuberculosis", "vaccine", -0.1),      # rarely together (3)
    ("aspirin", "photosynthesis", -0.3),    # both words occur, never together
])
def test_scifact_known_pairs(scifact_index, scifact_words, head, tail, reward):
    count = scifact_index.count_cooccurrence([head], [tail], window=1000)
    assert count == engine_count(scifact_index, [head], [tail], 1000)  # infini-gram's own count_cnf
    document = scifact_index.count_cooccurrence([head], [tail], window=1000, semantics="document")
    assert document == brute_force_count(scifact_words, head, tail, 1000) >= count
    assert count_reward(count) == reward
    assert scifact_index.count_cooccurrence([head], [tail], window=1000) == count  # cached clause, same answer


def test_scifact_nonsense_and_unknown_words_count_zero(scifact_index, scifact_words):
    assert brute_force_count(scifact_words, "photosynthesis", "photosynthesis", 0) == 1  # the word exists once
    assert scifact_index.count_cooccurrence(["zebra"], ["insulin"]) == 0                  # not in the corpus at all
    assert scifact_index.count_cooccurrence(["insulin"], ["quantum chromodynamics"]) == 0


def random_queries(vocabulary: list[str], count: int, seed: int):
    """(head, tail, window) with one or two phrases a side, common words, bigrams and rare words mixed."""
    rng = random.Random(seed)
    common = [word for word in vocabulary[50:3000] if not word.isdigit()]
    rare = vocabulary[3000:]
    bigrams = [" ".join(pair) for pair in zip(common[::2], common[1::2])]
    for _ in range(count):
        head = [rng.choice(common + bigrams) for _ in range(rng.randint(1, 2))]
        tail = [rng.choice(common + rare) for _ in range(rng.randint(1, 2))]
        yield head, tail, rng.choice([1, 3, 30, 1000])


def test_scifact_index_equals_memory_counter_and_the_engine(scifact_index, scifact_texts):
    memory = MemoryCounter(scifact_texts)
    assert memory.tokenizer.vocabulary == scifact_index.tokenizer.vocabulary
    for head, tail, window in random_queries(memory.tokenizer.vocabulary, 150, seed=0):
        engine = engine_count(scifact_index, head, tail, window)
        assert scifact_index.count_cooccurrence(head, tail, window) == engine, (head, tail, window)
        assert memory.count_cooccurrence(head, tail, window) == engine, (head, tail, window)
        assert (scifact_index.count_cooccurrence(head, tail, window, semantics="document")
                == memory.count_cooccurrence(head, tail, window, semantics="document")), (head, tail, window)
    assert scifact_index.count_cooccurrence(["cells"], ["patients"], 0) == 0  # window 0: never two starts


def test_subsampled_counts_equal_the_engine(scifact_index):
    # Above max_clause_freq infini-gram keeps a seeded contiguous slice of a phrase's suffix-array range and
    # scales the count back by integer ratios; the index takes the same slice, so the estimate is the engine's.
    index = CorpusIndex(scifact_index.path, max_clause_freq=500)
    for head, tail in [(["the"], ["of"]), (["cells"], ["patients"]), (["insulin"], ["the"]), (["and", "in"], ["with"])]:
        for window in (1, 10, 1000):
            assert index.count_cooccurrence(head, tail, window) == engine_count(index, head, tail, window)
    assert index.clause("the").scale > 1 and len(index.clause("the").positions) <= 500


def test_memory_counter_on_three_documents():
    counter = MemoryCounter(["Marie Curie won the Nobel Prize.", "Paris is in France.", "Curie, Nobel."])
    assert counter.count_cooccurrence(["Marie Curie"], ["Nobel"]) == 1
    assert counter.count_cooccurrence(["zebra"], ["Nobel"]) == 0
    # The second "Curie, Nobel." has its partner right after it, but the engine's range also takes the nearer
    # "Nobel" of the first document on its left, crosses two separators and is dropped (a 5-token window keeps it):
    assert counter.count_cooccurrence(["Curie"], ["Nobel"]) == 1
    assert counter.count_cooccurrence(["Curie"], ["Nobel"], 5) == 2
    assert counter.count_cooccurrence(["Curie"], ["Nobel"], semantics="document") == 2


def test_windows_do_not_cross_documents(tmp_path):
    # "b" sits 1 token after "a" but in the next document: never counted, whatever the window
    texts = ["x a", "b y", "a b"]
    counter = MemoryCounter(texts)
    assert counter.count_cooccurrence(["a"], ["b"], window=10**6, semantics="document") == 1
    assert counter.count_cooccurrence(["a"], ["b"], window=0) == 0  # different starts need a window >= 1
    # The engine's definition: the second "a" takes the "b" of document 2 on its left as well as its own
    # partner on its right, the range crosses two separators and is dropped; a 1-token window keeps it.
    index = CorpusIndex(build_index(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "index"))
    for window, expected in ((10**6, 0), (1, 1)):
        assert counter.count_cooccurrence(["a"], ["b"], window) == expected
        assert index.count_cooccurrence(["a"], ["b"], window) == engine_count(index, ["a"], ["b"], window) == expected


def test_query_validation(tiny_index):
    index = CorpusIndex(tiny_index)
    with pytest.raises(ValueError, match="lists of phrases"):
        index.count_cooccurrence("Paris", ["France"])
    with pytest.raises(ValueError, match="at least one head"):
        index.count_cooccurrence([], ["France"])
    with pytest.raises(ValueError, match="window"):
        index.count_cooccurrence(["Paris"], ["France"], window=-1)
    assert index.count_cooccurrence(["Paris"], ["!!!"]) == 0  # a phrase without a word never occurs


def test_engine_path_quirk_and_working_directory(tmp_path, tiny_index):
    # infini-gram classifies its files by substrings of the whole path: "table" or "offset" in a parent
    # directory would crash it; building and opening there must still work.
    before = os.getcwd()
    quirky = build_index(write_jsonl(tmp_path / "c.jsonl", TINY), tmp_path / "offset_table_metadata" / "tokenized")
    assert os.getcwd() == before
    assert sorted(path.name for path in quirky.iterdir()) == [
        "nanogrpo-index.json", "offset.0", "table.0", "tokenized.0", "vocab.txt"]
    normal, odd = CorpusIndex(tiny_index), CorpusIndex(quirky)
    for head, tail in [(["Paris"], ["France"]), (["Curie"], ["Paris"]), (["Nobel"], ["Physics"])]:
        assert odd.count_cooccurrence(head, tail, 3) == normal.count_cooccurrence(head, tail, 3) > 0
    assert len(list(quirky.iterdir())) == 5  # removing the neutral link left the index itself alone


def test_builder_failure_becomes_runtime_error_and_cleans_up(tmp_path):
    # the quirk that makes the default one CPU for tiny corpora: two builder jobs on a few bytes fail
    with pytest.raises(RuntimeError, match="suffix-array builder failed"):
        build_index(write_jsonl(tmp_path / "c.jsonl", TINY), tmp_path / "index", cpus=2)
    assert not (tmp_path / "index").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda path: (path / "table.0").unlink(), "table.0"),
    (lambda path: (path / "tokenized.0").write_bytes((path / "tokenized.0").read_bytes()[:-2]), "tokenized.0"),
    (lambda path: (path / "table.0").write_bytes(b"\xff" * (path / "table.0").stat().st_size), "table.0"),
    (lambda path: (path / "offset.0").write_bytes(bytes(8) * 4), "offset.0"),
    (lambda path: (path / "nanogrpo-index.json").write_text("{broken"), "nanogrpo-index.json"),
    (lambda path: (path / "nanogrpo-index.json").unlink(), "nanogrpo-index.json"),
    (lambda path: (path / "vocab.txt").write_text("one\n"), "vocab.txt"),
])
def test_corrupt_index_fails_at_construction(tmp_path, tiny_index, damage, message):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_index, broken)
    damage(broken)
    with pytest.raises(ValueError) as error:
        CorpusIndex(broken)
    assert message in str(error.value) and str(broken) in str(error.value)
    assert f"python -m rewards.corpus build --input corpus.jsonl --out {broken}" in str(error.value)


def test_missing_index_names_path_and_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"--out {tmp_path / 'absent'}")):
        CorpusIndex(tmp_path / "absent")


def test_build_input_errors(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", TINY)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build_index(corpus, tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        build_index(tmp_path / "absent.jsonl", tmp_path / "a")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*'text'"):
        build_index(tmp_path / "bad.jsonl", tmp_path / "b")
    (tmp_path / "junk.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"junk.jsonl:1: invalid JSON"):
        build_index(tmp_path / "junk.jsonl", tmp_path / "c")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the file has no records"):
        build_index(tmp_path / "empty.jsonl", tmp_path / "d")
    assert not any((tmp_path / name).exists() for name in "abcd")


def byte_level_pieces(text: str) -> list[str]:
    """GPT-2-like pre-tokenisation: a word keeps its leading space, so 'Paris' and ' Paris' differ."""
    return re.findall(r" ?[^\W_]+| ?[^\w\s]+|\s+", text)


def fake_bpe(offset: int, modulus: int):
    return lambda text: [zlib.crc32(piece.encode()) % modulus + offset for piece in byte_level_pieces(text)]


def test_external_tokenizer_or_of_space_variants(tmp_path):
    texts = ["Paris is big. Paris, France.", "France and Paris.", "paris france"]
    encode = fake_bpe(1, 60000)
    path = build_index(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "index", encode_fn=encode,
                       tokenizer_name="fake-bpe")
    index = CorpusIndex(path, encode_fn=encode)
    memory = MemoryCounter(texts, tokenizer=ExternalTokenizer(encode))
    # "Paris" at a document start, " Paris" mid-sentence, "paris" lower-case: all 4 found only with the OR
    assert len(index.clause("Paris")[0]) == len(memory.clause("Paris")[0]) == 4
    assert len(ExternalTokenizer(encode).variants("Paris")) == 4  # Paris, " Paris", paris, " paris"
    document = [counter.count_cooccurrence(["Paris"], ["France"], 1000, semantics="document")
                for counter in (index, memory)]
    assert document == [3, 3]  # each of the 3 documents has both
    # the engine: the ranges of documents 2 and 3 reach a partner in the previous document and are dropped
    engine = [counter.count_cooccurrence(["Paris"], ["France"], 1000) for counter in (index, memory)]
    assert engine == [engine_count(index, ["Paris"], ["France"], 1000)] * 2 == [1, 1]
    with pytest.raises(ValueError, match="encode_fn"):
        CorpusIndex(path)
    with pytest.raises(ValueError, match="not the tokenizer"):
        CorpusIndex(path, encode_fn=fake_bpe(2, 60000))


def test_external_ids_beyond_one_token_take_two(tmp_path):
    # ids 65,000..65,999 do not all fit one 16-bit token (<= 65,279): the index stores two tokens per id
    texts = ["Paris is big. Paris, France.", "France and Paris.", "paris france"]
    encode = fake_bpe(65000, 1000)
    path = build_index(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "index", encode_fn=encode)
    index = CorpusIndex(path, encode_fn=encode)
    memory = MemoryCounter(texts, tokenizer=ExternalTokenizer(encode))
    assert index.layout == "u16x2" and list(index.clause("Paris").positions) == list(memory.clause("Paris").positions)
    for window in (1, 2, 1000):
        assert index.count_cooccurrence(["Paris"], ["France"], window) == memory.count_cooccurrence(
            ["Paris"], ["France"], window) == engine_count(index, ["Paris"], ["France"], window)


def test_ids_beyond_the_index_fail_at_build_time_naming_the_number(tmp_path):
    with pytest.raises(ValueError, match=f"token id {MAX_PAIR_ID + 1:,}, beyond the largest id the index stores"):
        build_index(write_jsonl(tmp_path / "c.jsonl", TINY), tmp_path / "index",
                    encode_fn=lambda text: [MAX_PAIR_ID + 1])
    assert not (tmp_path / "index").exists()


def test_layout_by_largest_id():
    assert (choose_layout(65_279), choose_layout(65_280), choose_layout(1_065_336_959)) == ("u16", "u16x2", "u16x2")


def test_more_distinct_words_than_the_index_holds_fail_naming_the_number(tmp_path, monkeypatch):
    # a billion distinct words cannot be made in a test: the limits are lowered instead (word ids 1..4)
    monkeypatch.setattr("rewards.corpus.MAX_SINGLE_ID", 1)
    monkeypatch.setattr("rewards.corpus.MAX_PAIR_ID", 3)
    with pytest.raises(ValueError, match="c.jsonl has token id 4, beyond the largest id the index stores, 3 "):
        build_index(write_jsonl(tmp_path / "c.jsonl", ["a b", "c d"]), tmp_path / "index")
    assert not (tmp_path / "index").exists()


@pytest.fixture(scope="module")
def large_vocabulary(tmp_path_factory) -> tuple[list[str], CorpusIndex]:
    """70,400 distinct words (more than 65,534): "common" and "topic" in every document, then 100 words
    of their own per document, each used once, so the rarest words rank beyond any 16-bit id."""
    texts = [f"common {' '.join(f'w{d}x{k}' for k in range(50))} topic {' '.join(f'v{d}x{k}' for k in range(50))}"
             for d in range(704)]
    directory = tmp_path_factory.mktemp("large")
    return texts, CorpusIndex(build_index(write_jsonl(directory / "c.jsonl", texts), directory / "index"))


def test_more_words_than_16_bits_count_exactly(large_vocabulary):
    texts, index = large_vocabulary
    vocabulary = index.tokenizer.vocabulary
    assert len(vocabulary) == 2 + 704 * 100 > 65_534 and index.layout == "u16x2"
    rarest = vocabulary[-1]  # id 70,402, beyond 16 bits: the old index counted it 0
    assert rarest == "w9x9" and index.tokenizer.ids[rarest] > MAX_SINGLE_ID
    # document 9: "w9x9" is word 10 (0-based), "topic" word 51: 41 apart
    assert [index.count_cooccurrence([rarest], ["topic"], window) for window in (40, 41)] == [0, 1]
    assert index.count_cooccurrence(["w9x8 w9x9"], ["v9x0"], 1000) == 1  # a phrase of two rare words
    memory = MemoryCounter(texts)
    rng = random.Random(1)
    for _ in range(60):
        head = [rng.choice(vocabulary[:3] + vocabulary[-5000:])]
        tail = [rng.choice(["common", "topic", *rng.sample(vocabulary[-70000:], 1)])]
        window = rng.choice([1, 10, 60, 1000])
        engine = engine_count(index, head, tail, window)
        assert index.count_cooccurrence(head, tail, window) == memory.count_cooccurrence(head, tail, window) == engine
        assert (index.count_cooccurrence(head, tail, window, semantics="document")
                == memory.count_cooccurrence(head, tail, window, semantics="document"))


def test_small_vocabulary_keeps_one_token_per_word(tmp_path):
    texts = ["a a a b b", "c rare1 rare2 b", "c rare3 a"]
    index = CorpusIndex(build_index(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "index"))
    assert index.layout == "u16" and index.meta["tokens"] == 6 + 5 + 4  # a separator + one token per word
    assert index.tokenizer.vocabulary[:3] == ["a", "b", "c"]  # by frequency: a 4, b 3, c 2; every word kept
    assert index.count_cooccurrence(["rare1"], ["b"], window=2) == 1  # rare words count (no vocabulary cap)
    # document 2 is "c rare1 rare2 b": b is 3 words after c. The engine's range for that c also reaches the
    # b ending document 1 (2 before it) and crosses the separator: dropped; per document it counts.
    assert [index.count_cooccurrence(["c"], ["b"], window=w, semantics="document") for w in (2, 3)] == [0, 1]
    assert [index.count_cooccurrence(["c"], ["b"], window=w) for w in (2, 3)] == [0, 0]
    assert engine_count(index, ["c"], ["b"], 3) == 0


def test_cli_build_and_count(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", TINY)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a relative --out: the builder chdirs, so it must be handed the absolute path
    build = subprocess.run([sys.executable, "-m", "rewards.corpus", "build", "--input", str(corpus), "--out", "index"],
                           cwd=tmp_path, capture_output=True, text=True, env=environment, timeout=120)
    assert build.returncode == 0, build.stderr
    assert "4 documents" in build.stdout
    count = subprocess.run([sys.executable, "-m", "rewards.corpus", "count", "--index", str(tmp_path / "index"),
                            "--head", "Paris", "--tail", "France"], capture_output=True, text=True, env=environment,
                           timeout=120)
    # the engine: the first "France" also reaches the "Paris" opening the next document and its range crosses
    # the separator; per document both documents count
    assert (count.returncode, count.stdout.strip()) == (0, "1")
    document = subprocess.run([sys.executable, "-m", "rewards.corpus", "count", "--index", str(tmp_path / "index"),
                               "--head", "Paris", "--tail", "France", "--semantics", "document"], capture_output=True,
                              text=True, env=environment, timeout=120)
    assert (document.returncode, document.stdout.strip()) == (0, "2")


def test_registered_factqa_corpus_opens_the_index(tiny_index, monkeypatch):
    text = "<think>Marie Curie won the Nobel Prize.</think>\n<answer>Marie Curie</answer>"
    result = compute_score("factqa_corpus", text, "Marie Curie", {"corpus_index": str(tiny_index)})
    # (Marie Curie, won, Nobel Prize) co-occurs once in the tiny corpus: 1..4 -> -0.1
    assert result["sentences"][0] == (7, 39, -0.1)
    assert result["score"] == 3.0
    monkeypatch.setenv("NANOGRPO_CORPUS_INDEX", str(tiny_index))
    assert compute_score("factqa_corpus", text, "Marie Curie") == result
