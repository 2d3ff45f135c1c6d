"""Score completions with the reward registry: the one place a completion becomes a reward, a 0/1 correctness,
a format success and per-token sentence shaping, for training and held-out evaluation alike. A reward function
that fails raises with the row named: it never becomes a 0 that looks like a judgement (docs/conventions.md)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo.alignment import sentence_shaping, token_char_spans, token_sentence_index

CORRECTNESS_KEYS = ("acc", "correct", "answer")  # first component found is the 0/1 correctness


def correctness(result: dict, score: float, threshold: float) -> float:
    """1.0 when the first of CORRECTNESS_KEYS in `result` (else the score) is at least `threshold`, else 0.0."""
    for key in CORRECTNESS_KEYS:
        if key in result:
            return float(float(result[key]) >= threshold)
    return float(score >= threshold)


def numeric_components(result: dict) -> dict[str, float]:
    """The reward's numeric components besides its score ("format", "evidence", ...), as floats."""
    return {key: float(value) for key, value in result.items()
            if key not in ("score", "sentences") and isinstance(value, (int, float, bool))}


def format_success(result: dict) -> float:
    """The one definition of format success: 1.0 when the reward's `format` component is 1 (every block the
    protocol asks for is there), 0.0 below, NaN when the reward has no format component (rates skip NaN)."""
    value = result.get("format")
    return math.nan if value is None else float(float(value) >= 1.0)


@dataclass
class Scores:
    """B scored completions."""
    rewards: Tensor  # [B] float32, the outcome reward (score)
    correct: Tensor  # [B] float32 0/1
    token_shaping: Tensor  # [B, T] float32 sentence shaping (zeros without sentence rewards), T = longest completion
    components: dict[str, list[float]] = field(default_factory=dict)  # each B floats, NaN where a reward lacks it


@dataclass(frozen=True)
class Scorer:
    """Everything scoring needs besides the completions. compute_scores (launch/reward_pool.py), when given, scores
    many calls at once: one outcome per call, its result, its exception, or None for a call not made after a failure."""
    compute_score: Callable
    decode_prefixes: Callable[[Sequence[int]], list[str]]  # ids -> [decode(ids[:k]) for k in 0..len(ids)]
    sentence_coef: float = 1.0
    correct_threshold: float = 0.5
    compute_scores: Callable[[list[tuple]], list] | None = None

    @staticmethod
    def _call(row: dict, text: str) -> tuple:
        """compute_score's arguments (verl's signature)."""
        return row["data_source"], text, row.get("reward_model", {}).get("ground_truth"), row.get("extra_info")

    @staticmethod
    def _checked(outcome, row: dict, position: int) -> dict:
        """The reward's result as a dict with a float "score"; an error raised with the row named."""
        if isinstance(outcome, BaseException):
            index = (row.get("extra_info") or {}).get("index")
            which = f"row index {index}" if index is not None else f"completion {position} of the batch (no index)"
            raise RuntimeError(f"reward {row.get('data_source')!r} failed on {which}: {outcome}") from outcome
        result = dict(outcome) if isinstance(outcome, dict) else {"score": float(outcome)}
        result["score"] = float(result["score"])
        return result

    def result(self, row: dict, text: str, position: int = 0) -> dict:
        """The reward function's result for one completion of `row`, always a dict with a float "score"."""
        try:
            outcome = self.compute_score(*self._call(row, text))
        except Exception as error:
            outcome = error
        return self._checked(outcome, row, position)

    def results(self, texts: Sequence[str], rows: Sequence[dict]) -> list[dict]:
        """result() for each completion, all at once through compute_scores when given; the first failure raises."""
        if self.compute_scores is None:
            return [self.result(row, text, b) for b, (text, row) in enumerate(zip(texts, rows))]
        outcomes = self.compute_scores([self._call(row, text) for text, row in zip(texts, rows)])
        for b, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                self._checked(outcome, rows[b], b)
        return [self._checked(outcome, row, b) for b, (outcome, row) in enumerate(zip(outcomes, rows))]

    def score(self, texts: Sequence[str], completion_ids: Sequence[Sequence[int]], rows: Sequence[dict]) -> Scores:
        """B completions and their rows, scored: token_shaping[b, t] = sentence_coef * r_sent(t's sentence), else 0."""
        results = self.results(texts, rows)
        token_shaping = torch.zeros(len(texts), max((len(ids) for ids in completion_ids), default=0))
        for b, (ids, result) in enumerate(zip(completion_ids, results)):
            if sentences := result.get("sentences"):
                index = token_sentence_index(token_char_spans(self.decode_prefixes(ids)),
                                             [(start, end) for start, end, _ in sentences])
                token_shaping[b, : len(ids)] = sentence_shaping(index, [r for _, _, r in sentences], self.sentence_coef)
        numeric = [numeric_components(result) for result in results]
        keys = dict.fromkeys(key for values in numeric for key in values)  # in order of first appearance
        correct = [correctness(result, result["score"], self.correct_threshold) for result in results]
        return Scores(torch.tensor([result["score"] for result in results], dtype=torch.float32),
                      torch.tensor(correct, dtype=torch.float32), token_shaping,
                      {key: [values.get(key, math.nan) for values in numeric] for key in keys})
