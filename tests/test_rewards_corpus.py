"""The infini-gram corpus index: built from SciFact in the suite, checked against a brute-force count and the
in-memory counter, plus the engine quirks (path names, tiny corpora, cwd), corrupt indexes and the CLI."""
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

from rewards import compute_score
from rewards.cooccurrence import ExternalTokenizer, MemoryCounter
from rewards.corpus import CorpusIndex, build_index
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
    ("insulin", "diabetes", 0.1),           # co-occur in many abstracts
    ("Alzheimer", "amyloid", 0.1),
    ("type 2 diabetes", "insulin", 0.1),    # a phrase
    ("tuberculosis", "vaccine", -0.1),      # rarely together (3)
    ("aspirin", "photosynthesis", -0.3),    # both words occur, never together
])
def test_scifact_known_pairs(scifact_index, scifact_words, head, tail, reward):
    count = scifact_index.count_cooccurrence([head], [tail], window=1000)
    assert count == brute_force_count(scifact_words, head, tail, 1000)
    assert count_reward(count) == reward
    assert scifact_index.count_cooccurrence([head], [tail], window=1000) == count  # cached clause, same answer


def test_scifact_nonsense_and_unknown_words_count_zero(scifact_index, scifact_words):
    assert brute_force_count(scifact_words, "photosynthesis", "photosynthesis", 0) == 1  # the word exists once
    assert scifact_index.count_cooccurrence(["zebra"], ["insulin"]) == 0                  # not in the corpus at all
    assert scifact_index.count_cooccurrence(["insulin"], ["quantum chromodynamics"]) == 0


def test_scifact_index_equals_memory_counter(scifact_index, scifact_texts):
    memory = MemoryCounter(scifact_texts)
    assert memory.tokenizer.vocabulary == scifact_index.tokenizer.vocabulary
    rng = random.Random(0)
    common = [word for word in memory.tokenizer.vocabulary[50:3000] if not word.isdigit()]
    rare = memory.tokenizer.vocabulary[3000:30000]
    bigrams = [" ".join(pair) for pair in zip(common[::2], common[1::2])]
    for _ in range(150):
        head = [rng.choice(common + bigrams) for _ in range(rng.randint(1, 2))]
        tail = [rng.choice(common + rare) for _ in range(rng.randint(1, 2))]
        window = rng.choice([0, 3, 30, 1000])
        assert scifact_index.count_cooccurrence(head, tail, window) == memory.count_cooccurrence(head, tail, window), (head, tail, window)


def test_windows_do_not_cross_documents():
    # "b" sits 1 token after "a" but in the next document: never counted, whatever the window
    counter = MemoryCounter(["x a", "b y", "a b"])
    assert counter.count_cooccurrence(["a"], ["b"], window=10**6) == 1
    assert counter.count_cooccurrence(["a"], ["b"], window=0) == 0  # different starts need a window >= 1


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
        assert odd.count_cooccurrence(head, tail) == normal.count_cooccurrence(head, tail) > 0


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
    with pytest.raises(ValueError, match=r"junk.jsonl:1: not valid JSON"):
        build_index(tmp_path / "junk.jsonl", tmp_path / "c")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no document"):
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
    assert index.count_cooccurrence(["Paris"], ["France"], 1000) == memory.count_cooccurrence(["Paris"], ["France"], 1000) == 3
    with pytest.raises(ValueError, match="encode_fn"):
        CorpusIndex(path)
    with pytest.raises(ValueError, match="not the tokenizer"):
        CorpusIndex(path, encode_fn=fake_bpe(2, 60000))


def test_external_ids_must_fit_16_bits(tmp_path):
    with pytest.raises(ValueError, match=r"outside \[0, 65534\]"):
        build_index(write_jsonl(tmp_path / "c.jsonl", TINY), tmp_path / "index", encode_fn=fake_bpe(65000, 1000))
    assert not (tmp_path / "index").exists()


def test_word_vocabulary_cap_keeps_positions(tmp_path):
    # with 3 words kept, rarer words are unknown (count 0) but still occupy their positions
    texts = ["a a a b b", "c rare1 rare2 b", "c rare3 a"]
    path = build_index(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "index", max_words=3)
    index = CorpusIndex(path)
    assert index.tokenizer.vocabulary == ["a", "b", "c"]  # by frequency: a 4, b 3, c 2
    assert index.count_cooccurrence(["rare1"], ["b"]) == 0
    assert index.count_cooccurrence(["c"], ["b"], window=3) == 1  # document 2: b is 3 tokens after c
    assert index.count_cooccurrence(["c"], ["b"], window=2) == 0
    assert index.count_cooccurrence(["c"], ["a"], window=2) == 1  # document 3: c, rare3, a
    memory = MemoryCounter(texts, tokenizer=index.tokenizer)
    assert [memory.count_cooccurrence(["c"], ["b"], window=w) for w in (2, 3)] == [0, 1]


def test_cli_build_and_count(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", TINY)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    build = subprocess.run([sys.executable, "-m", "rewards.corpus", "build", "--input", str(corpus), "--out",
                            str(tmp_path / "index")], capture_output=True, text=True, env=environment, timeout=120)
    assert build.returncode == 0, build.stderr
    assert "4 documents" in build.stdout
    count = subprocess.run([sys.executable, "-m", "rewards.corpus", "count", "--index", str(tmp_path / "index"),
                            "--head", "Paris", "--tail", "France"], capture_output=True, text=True, env=environment,
                           timeout=120)
    assert (count.returncode, count.stdout.strip()) == (0, "2")


def test_registered_factqa_corpus_opens_the_index(tiny_index, monkeypatch):
    text = "<think>Marie Curie won the Nobel Prize.</think>\n<answer>Marie Curie</answer>"
    result = compute_score("factqa_corpus", text, "Marie Curie", {"corpus_index": str(tiny_index)})
    # (Marie Curie, won, Nobel Prize) co-occurs once in the tiny corpus: 1..4 -> -0.1
    assert result["sentences"][0] == (7, 39, -0.1)
    assert result["score"] == 3.0
    monkeypatch.setenv("NANOGRPO_CORPUS_INDEX", str(tiny_index))
    assert compute_score("factqa_corpus", text, "Marie Curie") == result
