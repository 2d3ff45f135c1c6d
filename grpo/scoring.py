"""Score completions with the reward registry and turn sentence rewards into per-token shaping.

A reward function that fails raises here with the row named: it never becomes a 0 that looks like a
judgement (DESIGN.md, "no silent no-learning").
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo.alignment import sentence_shaping, token_char_spans, token_sentence_index

CORRECTNESS_KEYS = ("acc", "correct", "answer")  # first component found is the 0/1 correctness


@dataclass
class Scores:
    rewards: Tensor  # [B] float32, the outcome reward (score)
    correct: Tensor  # [B] float32 0/1
    token_shaping: Tensor | None  # [B, T] float32 sentence shaping, None when no reward gave sentences
    components: dict[str, list[float]] = field(default_factory=dict)


def correctness(result: dict, score: float, threshold: float) -> float:
    for key in CORRECTNESS_KEYS:
        if key in result:
            return float(float(result[key]) >= threshold)
    return float(score >= threshold)


def score_completions(
    texts: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    rows: Sequence[dict],
    compute_score: Callable,
    decode_prefixes: Callable[[Sequence[int]], list[str]],
    *,
    sentence_coef: float = 1.0,
    correct_threshold: float = 0.5,
) -> Scores:
    """texts, completion_ids, rows: B aligned entries (row b is the prompt row of completion b).

    decode_prefixes(ids) -> [decode(ids[:k]) for k in 0..len(ids)], used only for sentence rewards.
    Returns Scores; token_shaping[b, t] = sentence_coef * r_sent of the sentence holding token t.
    """
    if not (len(texts) == len(completion_ids) == len(rows)):
        raise ValueError(f"texts ({len(texts)}), completion_ids ({len(completion_ids)}) and rows ({len(rows)}) differ")
    rewards, correct, shaping_rows, components = [], [], [], {}
    for b, (text, ids, row) in enumerate(zip(texts, completion_ids, rows)):
        ground_truth = row.get("reward_model", {}).get("ground_truth")
        try:
            result = compute_score(row["data_source"], text, ground_truth, row.get("extra_info"))
        except Exception as error:
            index = row.get("extra_info", {}).get("index", b)
            raise RuntimeError(f"reward {row.get('data_source')!r} failed on row index {index}: {error}") from error
        if not isinstance(result, dict):
            result = {"score": float(result)}
        score = float(result["score"])
        rewards.append(score)
        correct.append(correctness(result, score, correct_threshold))
        for key, value in result.items():
            if key not in ("score", "sentences") and isinstance(value, (int, float, bool)):
                components.setdefault(key, [float("nan")] * b).append(float(value))
        for values in components.values():  # keep every component list aligned with b
            if len(values) < b + 1:
                values.append(float("nan"))
        sentences = result.get("sentences")
        if sentences:
            spans = token_char_spans(decode_prefixes(ids))
            index = token_sentence_index(spans, [(s, e) for s, e, _ in sentences])
            shaping_rows.append(sentence_shaping(index, [r for _, _, r in sentences], sentence_coef))
        else:
            shaping_rows.append(torch.zeros(len(ids)))
    token_shaping = None
    if any(bool(row.abs().sum() > 0) for row in shaping_rows):  # all zero: plain outcome advantages
        width = max(len(ids) for ids in completion_ids)
        token_shaping = torch.zeros(len(texts), width)
        for b, row in enumerate(shaping_rows):
            token_shaping[b, : row.shape[0]] = row
    return Scores(torch.tensor(rewards, dtype=torch.float32), torch.tensor(correct, dtype=torch.float32),
                  token_shaping, components)
