"""Corpus-grounded factual-QA reward (`factqa_corpus`): an outcome judge plus sentence-level process shaping.

score = judge + format, in {-2, 0, 1, 3}: judge +2 when the normalised `<answer>` equals, contains or is
contained in a gold alias (ground truth: aliases joined by `;`), else -1 (also for an empty answer or a
refusal); format +1 for `<think>T</think><answer>A</answer>` with a non-trivial T, else -1.
sentences = [(char_start, char_end, r_sent)]: each sentence's triple, its head and tail content words counted
together within 1000 tokens of a reference corpus (rewards.cooccurrence), the count mapped by COUNT_REWARDS
(the corpus paper's thresholds, where its sentence accuracy jumps from 23% at count 0 to 81% at >= 20).
The trainer adds sentence_coef * r_sent to those sentences' tokens (docs/conventions.md, "Sentence rewards"),
an order of magnitude below the judge."""
from __future__ import annotations

import functools
import os
import re
import unicodedata
from collections.abc import Callable

from rewards.cooccurrence import CooccurrenceCounter
from rewards.corpus import CorpusIndex
from rewards.parsing import extract_block, load_ground_truth, split_sentences, think_answer_format
from rewards.triples import RuleTripleExtractor, query_words

INDEX_ENV = "NANOGRPO_CORPUS_INDEX"
WINDOW_TOKENS = 1000
JUDGE_CORRECT, JUDGE_WRONG = 2.0, -1.0
FORMAT_GOOD, FORMAT_BAD = 1.0, -1.0
# (smallest count, reward) from the highest threshold down; no triple or query: 0.
COUNT_REWARDS = ((20, 0.1), (5, 0.0), (1, -0.1), (0, -0.3))
MAX_SENTENCES = 64  # a runaway completion is scored on its first sentences only (query cost is per sentence)
REFUSALS = frozenset({"dont know", "do not know", "unknown", "not sure", "no idea", "i have no idea", "cannot answer",
                      "i cannot answer", "i cant answer", "cannot be determined", "no answer"})
_REFUSAL_PREFIXES = ("i dont know", "i do not know", "im not sure", "i am not sure")  # also refusals on their own
_NOT_WORD = re.compile(r"[^\w\s]|_")
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
ALIAS_KEYS = ("aliases", "answers", "answer", "target")


def count_reward(count: int | None) -> float:
    """Sentence reward for a co-occurrence count by COUNT_REWARDS (None: no triple or nothing to query)."""
    return 0.0 if count is None else next(reward for threshold, reward in COUNT_REWARDS if count >= threshold)


def normalize_answer(text: str) -> str:
    """NFKD (accents split off, then dropped), lower-case, punctuation removed, articles dropped, spaces collapsed:
    "  The Café-Crème, Inc. " -> "cafecreme inc"."""
    text = _NOT_WORD.sub("", unicodedata.normalize("NFKD", text).lower())
    return " ".join(_ARTICLES.sub(" ", text).split())


def parse_aliases(ground_truth: object) -> list[str]:
    """Normalised gold aliases from `alias;alias`, a JSON list, or a JSON object with aliases/answers/answer/
    target (a list or a `;`-joined string); ValueError naming the field when none is usable."""
    value = load_ground_truth(ground_truth)
    field = "ground_truth"
    if isinstance(value, dict):
        present = [key for key in ALIAS_KEYS if key in value]
        if not present:
            raise ValueError(f"field 'aliases' (or {ALIAS_KEYS[1:]}) missing from ground truth {value!r:.200}")
        field = present[0]
        values = [value[key] for key in present]
    else:
        values = [value]
    aliases: list[str] = []
    for item in values:
        for alias in item if isinstance(item, list) else [item]:
            if not isinstance(alias, str):
                raise ValueError(f"field '{field}' must hold strings, got {type(alias).__name__} in "
                                 f"{ground_truth!r:.200}")
            aliases.extend(normalize_answer(part) for part in alias.split(";"))
    aliases = [alias for alias in dict.fromkeys(aliases) if alias]
    if not aliases:
        raise ValueError(f"field '{field}' holds no non-empty answer alias: {ground_truth!r:.200}")
    return aliases


def judge_answer(answer: str | None, aliases: list[str]) -> float:
    """+2 when the normalised answer equals an alias or one contains the other at word boundaries
    ("paris" and "paris france" match, "us" and "houses" do not); -1 otherwise, when empty or a refusal."""
    prediction = normalize_answer(answer) if answer is not None else ""
    if not prediction or prediction in REFUSALS or prediction.startswith(_REFUSAL_PREFIXES):
        return JUDGE_WRONG
    padded = f" {prediction} "
    return JUDGE_CORRECT if any(f" {alias} " in padded or padded in f" {alias} " for alias in aliases) else JUDGE_WRONG


def judge(solution_str: str, ground_truth: object) -> float:
    """The judge on a completion's `<answer>` block: +2 or -1 (launch.self_filter's default judge)."""
    return judge_answer(extract_block(solution_str, "answer"), parse_aliases(ground_truth))


def format_reward(solution_str: str) -> float:
    """+1 for `<think>T</think><answer>A</answer>` (T at least 3 words, A non-empty), else -1."""
    return FORMAT_GOOD if think_answer_format(solution_str) else FORMAT_BAD


def sentence_rewards(solution_str: str, counter: CooccurrenceCounter,
                     extractor) -> tuple[list[tuple[int, int, float]], int]:
    """([(start, end, r_sent)] for the first MAX_SENTENCES sentences, how many of them had a query)."""
    sentences, queried = [], 0
    for start, end in split_sentences(solution_str)[:MAX_SENTENCES]:
        triple = extractor.extract(solution_str[start:end])
        words = query_words(triple) if triple is not None else None
        count = counter.count_cooccurrence(words[0], words[1], WINDOW_TOKENS) if words is not None else None
        queried += count is not None
        sentences.append((start, end, count_reward(count)))
    return sentences, queried


def make_factqa_reward(counter: CooccurrenceCounter, extractor=None) -> Callable[..., dict]:
    """The module docstring's reward on any `counter` with count_cooccurrence (register it under your own name)."""
    extractor = extractor if extractor is not None else RuleTripleExtractor()

    def factqa_reward(data_source: str, solution_str: str, ground_truth: object,
                      extra_info: dict | None = None) -> dict:
        judge_score = judge(solution_str, ground_truth)
        format_score = format_reward(solution_str)
        sentences, queried = sentence_rewards(solution_str, counter, extractor)
        mean = sum(reward for _, _, reward in sentences) / len(sentences) if sentences else 0.0
        return {"score": judge_score + format_score, "sentences": sentences, "judge": judge_score,
                "format": format_score, "correct": float(judge_score > 0), "sentence_count": float(len(sentences)),
                "sentences_queried": float(queried), "sentence_reward_mean": mean}

    return factqa_reward


@functools.cache
def _reward_for_index(path: str) -> Callable[..., dict]:
    return make_factqa_reward(CorpusIndex(path))


def factqa_corpus_reward(data_source: str, solution_str: str, ground_truth: object,
                         extra_info: dict | None = None) -> dict:
    """make_factqa_reward on the CorpusIndex at extra_info["corpus_index"] or $NANOGRPO_CORPUS_INDEX."""
    path = extra_info.get("corpus_index") if isinstance(extra_info, dict) else None
    path = path or os.environ.get(INDEX_ENV)
    if not path:
        raise ValueError(f"reward 'factqa_corpus' needs a corpus index: set {INDEX_ENV}=DIR or extra_info"
                         "['corpus_index'] (build one with: python -m rewards.corpus build --input corpus.jsonl "
                         "--out DIR), or register make_factqa_reward(counter) under your own name")
    return _reward_for_index(str(path))(data_source, solution_str, ground_truth, extra_info)
