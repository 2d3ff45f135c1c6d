"""Factual-QA reward: count thresholds, the string-match judge, format, triple extraction, the combined reward."""
import pytest

from memory_counter import MemoryCounter
from rewards import compute_score, register
from rewards.factqa import (
    count_reward,
    factqa_corpus_reward,
    format_reward,
    judge,
    judge_answer,
    make_factqa_reward,
    normalize_answer,
    parse_aliases,
)
from rewards.triples import ModelTripleExtractor, RuleTripleExtractor, Triple, parse_triple, query_words


@pytest.mark.parametrize("count, reward", [
    (None, 0.0), (0, -0.3), (1, -0.1), (4, -0.1), (5, 0.0), (19, 0.0), (20, 0.1), (21, 0.1),
])
def test_count_thresholds(count, reward):
    assert count_reward(count) == reward


@pytest.mark.parametrize("occurrences", [0, 1, 4, 5, 19, 20])
def test_count_thresholds_end_to_end(occurrences):
    # `occurrences` documents where Alpha and Beta co-occur, plus documents holding only one of them. The
    # documents are three words long and repeated: with the engine's definition a range would also reach the
    # neighbouring copy and be dropped (tests/test_rewards_corpus.py), so these count per document.
    counter = MemoryCounter(["Alpha founded Beta."] * occurrences + ["Alpha alone.", "Beta alone."],
                            semantics="document")
    assert counter.count_cooccurrence(["Alpha"], ["Beta"]) == occurrences
    result = make_factqa_reward(counter)("factqa_corpus", "Alpha founded Beta.", "x")
    assert result["sentences"] == [(0, 19, count_reward(occurrences))]


@pytest.mark.parametrize("answer, aliases, expected", [
    ("Paris", "Paris", 2.0),
    ("paris, france", "Paris", 2.0),             # contains an alias
    ("Paris", "Paris, France", 2.0),             # is contained in an alias
    ("The Beatles", "Beatles", 2.0),             # articles dropped
    ("an apple", "the Apple", 2.0),
    ("Café", "cafe", 2.0),                        # NFKD, accents dropped
    ("ZÜRICH", "Zurich", 2.0),
    ("U.S.", "US", 2.0),                          # punctuation removed
    ("London", "Paris;London;Rome", 2.0),         # any alias
    ("London", "Paris", -1.0),
    ("us", "houses", -1.0),                       # containment is at word boundaries
    ("I don't know", "Paris", -1.0),
    ("I do not know, maybe Paris", "Paris", -1.0),
    ("Unknown.", "Paris", -1.0),
    ("", "Paris", -1.0),
    ("  the  ", "Paris", -1.0),                   # normalises to nothing
    (None, "Paris", -1.0),                        # no answer block
])
def test_judge(answer, aliases, expected):
    assert judge_answer(answer, parse_aliases(aliases)) == expected
    completion = "<think>x</think>" if answer is None else f"<think>x</think><answer>{answer}</answer>"
    assert judge(completion, aliases) == expected


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("Ｆｕｌｌ width") == "full width"  # NFKD folds compatibility forms
    assert normalize_answer("a an the") == ""


@pytest.mark.parametrize("ground_truth, aliases", [
    ("Paris;City of Light", ["paris", "city of light"]),
    (" Paris ;; paris ", ["paris"]),
    ('["Paris", "Lutetia"]', ["paris", "lutetia"]),
    ('{"aliases": ["Paris"], "answer": "Lutetia"}', ["paris", "lutetia"]),
    ({"answers": "A;B"}, ["b"]),  # "A" is an article and normalises away
])
def test_parse_aliases(ground_truth, aliases):
    assert parse_aliases(ground_truth) == aliases


@pytest.mark.parametrize("ground_truth, field", [
    ('{"question": "x"}', "'aliases'"), (";;", "'ground_truth'"), ('{"aliases": [1]}', "'aliases'"),
    ('{"answer": "the"}', "'answer'"), (None, "'ground_truth'"),
])
def test_malformed_aliases_name_the_field(ground_truth, field):
    with pytest.raises(ValueError, match=field):
        make_factqa_reward(MemoryCounter(["x"]))("factqa_corpus", "<answer>x</answer>", ground_truth)


@pytest.mark.parametrize("text, expected", [
    ("<think>Paris is the capital of France.</think><answer>Paris</answer>", 1.0),
    ("<think>ok</think><answer>Paris</answer>", -1.0),
    ("<answer>Paris</answer>", -1.0),
    ("Paris", -1.0),
])
def test_format_reward(text, expected):
    assert format_reward(text) == expected


@pytest.mark.parametrize("sentence, triple", [
    ("Marie Curie won the Nobel Prize in Physics.", Triple("Marie Curie", "won", "Nobel Prize")),
    ("In 1903, Marie Curie won the Nobel Prize.", Triple("Marie Curie", "won", "Nobel Prize")),
    ("Paris is the capital of France.", Triple("Paris", "is", "France")),
    ("Marie Curie was born in 1867.", Triple("Marie Curie", "was", "1867")),
    ("The treatment reduced mortality in older patients.", Triple("treatment", "reduced", "mortality older patients")),
    ("She won the Nobel Prize.", None),            # pronoun head
    ("Marie Curie met him in Paris.", None),       # "met" is not a relation word here: no relation
    ("Marie Curie married him.", None),            # pronoun tail
    ("This is true.", None),
    ("Hello world", None),
    ("", None),
])
def test_rule_extractor(sentence, triple):
    assert RuleTripleExtractor().extract(sentence) == triple


def test_query_words_dedupe_without_a_cap():
    assert query_words(Triple("Marie Curie", "won", "Nobel Prize")) == (["Marie", "Curie"], ["Nobel", "Prize"])
    assert query_words(Triple("New York New", "is in", "York State")) == (["New", "York"], ["State"])
    # every content word is queried (the paper's AND over content words; no 3-word cap); "a" is a stopword
    assert query_words(Triple("a b c d e", "is", "f")) == (["b", "c", "d", "e"], ["f"])
    assert query_words(Triple("the", "is", "Paris")) is None


def test_model_extractor_prompt_and_parsing():
    prompts = []

    def generate(prompt: str) -> str:
        prompts.append(prompt)
        return {"A": " Marie Curie | won | Nobel Prize\nSentence: junk", "B": "NONE", "C": "she | won | it"}[prompt[-1]]

    extractor = ModelTripleExtractor(generate, template="Few-shot here.\nSentence: {sentence}\nTriple: {sentence}")
    assert extractor.extract("  sentence   A") == Triple("Marie Curie", "won", "Nobel Prize")
    assert prompts[0] == "Few-shot here.\nSentence: sentence A\nTriple: sentence A"
    assert extractor.extract("B") is None
    assert extractor.extract("C") is None
    default = ModelTripleExtractor(lambda prompt: "x")
    assert "{sentence}" not in default.prompt("Paris is big.") and default.prompt("Paris is big.").endswith(
        "Sentence: Paris is big.\nTriple:\n")
    with pytest.raises(ValueError, match="sentence"):
        ModelTripleExtractor(generate, template="no placeholder")


def test_model_extractor_errors_propagate():
    def broken(prompt: str) -> str:
        raise RuntimeError("model crashed")

    with pytest.raises(RuntimeError, match="model crashed"):
        ModelTripleExtractor(broken).extract("Paris is big.")


@pytest.mark.parametrize("output, triple", [
    ("(Paris | is capital of | France)", Triple("Paris", "is capital of", "France")),
    ("\n\nTriple: 'Paris' | \"is\" | `France`", Triple("Paris", "is", "France")),
    ("Paris | is | France | extra", None),
    ("he | won | it\nParis | is | France", Triple("Paris", "is", "France")),  # the first VALID triple
    ("NONE\nParis | is | France", None),  # the model said there is none; what follows is ignored
    ("junk\nSentence: Rome is big.\nTriple: Rome | is | big city", None),  # the next few-shot example
    ("Paris | | France", None),
    ("the | is | France", None),  # no content word in the head
    ("x" * 200 + " | is | France", None),
    ("", None),
    (None, None),
])
def test_parse_triple(output, triple):
    assert parse_triple(output) == triple


def test_combined_reward_exact_values():
    corpus = ["Marie Curie won the Nobel Prize in 1903."] * 25 + ["Paris is in France."] * 3 + ["Berlin lies."]
    reward = make_factqa_reward(MemoryCounter(corpus, semantics="document"))  # short repeated documents: see above
    s1, s2, s3, s4 = ("Marie Curie won the Nobel Prize.", "Paris is in France.", "She was born in Warsaw.",
                      "Berlin borders Atlantis.")
    text = f"<think>{s1} {s2}\n{s3} {s4}</think>\n<answer>Marie Curie</answer>"
    result = reward("factqa_corpus", text, "Marie Curie;Marie Sklodowska-Curie")
    spans = [(text.index(sentence), text.index(sentence) + len(sentence)) for sentence in (s1, s2, s3, s4)]
    answer_start = text.index("<answer>") + len("<answer>")
    spans.append((answer_start, answer_start + len("Marie Curie")))
    expected_rewards = [0.1, -0.1, 0.0, -0.3, 0.0]  # counts 25, 3, no triple (pronoun), 0 (Atlantis unknown), no relation
    assert result["sentences"] == [(start, end, reward) for (start, end), reward in zip(spans, expected_rewards)]
    assert (result["judge"], result["format"], result["score"], result["correct"]) == (2.0, 1.0, 3.0, 1.0)
    assert (result["sentence_count"], result["sentences_queried"]) == (5.0, 3.0)
    assert result["sentence_reward_mean"] == pytest.approx((0.1 - 0.1 - 0.3) / 5, abs=1e-12)


def test_registered_custom_factqa_reward_through_compute_score():
    counter = MemoryCounter(["Alpha founded Beta."] * 30, semantics="document")
    register("factqa_memory_test", make_factqa_reward(counter), overwrite=True)
    text = "<think>Alpha founded Beta.</think>\n<answer>Gamma</answer>"
    result = compute_score("factqa_memory_test", text, "Delta")
    # judge -1 (Gamma is not Delta) + format +1 (a three-word think block) = 0
    assert result["sentences"] == [(7, 26, 0.1), (43, 48, 0.0)]
    assert (result["judge"], result["format"], result["score"]) == (-1.0, 1.0, 0.0)


def test_registered_factqa_corpus_needs_an_index(monkeypatch):
    monkeypatch.delenv("NANOGRPO_CORPUS_INDEX", raising=False)
    with pytest.raises(ValueError, match="NANOGRPO_CORPUS_INDEX"):
        factqa_corpus_reward("factqa_corpus", "<answer>x</answer>", "x")
    monkeypatch.setenv("NANOGRPO_CORPUS_INDEX", "/nonexistent/nanogrpo-index")
    with pytest.raises(FileNotFoundError, match="python -m rewards.corpus build"):
        compute_score("factqa_corpus", "<answer>x</answer>", "x")
