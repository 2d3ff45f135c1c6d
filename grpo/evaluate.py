"""Held-out evaluation: greedy completions scored by the same reward functions as training."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from grpo.scoring import correctness


def evaluate(engine, rows: Sequence[dict], prompt_ids: Sequence[list[int]], compute_score: Callable, dist, *,
             max_new_tokens: int, batch_size: int = 16, correct_threshold: float = 0.5) -> dict:
    """Mean reward, accuracy and format success over `rows` (each rank takes every world_size-th row).

    Returns {"eval_reward", "eval_acc", "eval_format_rate", "eval_count"} reduced over ranks, and the
    per-example records of this rank under "records".
    """
    mine = list(range(dist.rank, len(rows), dist.world_size))
    sums = torch.zeros(4, dtype=torch.float64)  # reward, correct, format, count
    records = []
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        completions = engine.generate([prompt_ids[i] for i in chunk], n=1, max_new_tokens=max_new_tokens,
                                      temperature=0.0, top_p=1.0, top_k=0, stop=[], seed=0)
        for i, completion in zip(chunk, completions):
            row = rows[i]
            result = compute_score(row["data_source"], completion.text, row["reward_model"]["ground_truth"],
                                   row.get("extra_info"))
            result = result if isinstance(result, dict) else {"score": float(result)}
            score = float(result["score"])
            ok = correctness(result, score, correct_threshold)
            fmt = float(result.get("format", math.nan))
            sums += torch.tensor([score, ok, float(fmt >= 1.0) if not math.isnan(fmt) else 0.0, 1.0],
                                 dtype=torch.float64)
            records.append({"index": row.get("extra_info", {}).get("index", i), "completion": completion.text,
                            "reward": score, "correct": ok, "finish_reason": completion.finish_reason})
    sums = dist.all_reduce_sum(sums.to(dist.device)).cpu()
    count = max(float(sums[3]), 1.0)
    return {"eval_reward": float(sums[0]) / count, "eval_acc": float(sums[1]) / count,
            "eval_format_rate": float(sums[2]) / count, "eval_count": int(sums[3]), "records": records}
