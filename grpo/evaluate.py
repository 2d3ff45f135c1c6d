"""Held-out evaluation, the one path for the trainer's scores and `launch.eval`: greedy completions scored as
training scores them, per-prompt values kept so that each mean gets its 95% interval (grpo/stats.py)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from grpo.groups import Scorer, correctness, numeric_components
from grpo.stats import mean_interval


def greedy_completions(engine, prompt_ids: Sequence[list[int]], *, max_new_tokens: int, batch_size: int = 16,
                       rows: Sequence[dict] = (), tools=None) -> list:
    """Greedy completions in prompt order; each batch holds prompts of similar length (less left padding). With
    `tools` (rollout.tools.Tools) and the prompts' `rows`, multi-turn trajectories where a row's source has tools."""
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    completions: list = [None] * len(prompt_ids)
    request = dict(n=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, stop=[], seed=0)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        prompts = [prompt_ids[i] for i in chunk]
        outputs = (engine.generate(prompts, **request) if tools is None
                   else tools.generate(engine, prompts, [rows[i] for i in chunk], **request))
        for i, completion in zip(chunk, outputs):
            completions[i] = completion
    return completions


def score_record(scorer: Scorer, row: dict, text: str, position: int = 0) -> dict[str, float]:
    """One completion's held-out values: reward, acc (0/1), and every numeric component of the reward."""
    result = scorer.result(row, text, position)
    values = {"reward": result["score"], "acc": correctness(result, result["score"], scorer.correct_threshold)}
    return values | numeric_components(result)


def evaluate(engine, scorer: Scorer, rows: Sequence[dict], prompt_ids: Sequence[list[int]], dist, *,
             max_new_tokens: int, batch_size: int = 16, tools=None) -> dict:
    """Score every held-out row: each replica completes every dp_size-th row (the ranks of a tensor-parallel
    replica submit the same requests and its first rank reports them), and the values are gathered.

    Returns {"count": N, "values": {metric: [N per-prompt floats, NaN where a row's reward lacks it]}, "means":
    {metric: (mean, low, high)}, "records": this rank's [{"index", "completion", "finish_reason", **values}]}."""
    mine = list(range(dist.dp_rank, len(rows), dist.dp_size))
    completions = greedy_completions(engine, [prompt_ids[i] for i in mine], max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, rows=[rows[i] for i in mine], tools=tools)
    records = []
    for i, completion in zip(mine, completions):
        values = score_record(scorer, rows[i], completion.text, i)
        records.append({"index": rows[i].get("extra_info", {}).get("index", i), "completion": completion.text,
                        "finish_reason": completion.finish_reason, **values})
    # The columns: reward, acc, then the numeric components of each data source's reward, found by scoring an empty
    # completion of its first row (cheap, and the same on every rank, so ranks gather the same columns).
    names = ["reward", "acc"]
    first_rows = {row["data_source"]: row for row in reversed(rows)}
    for source in sorted(first_rows):
        names += [name for name in score_record(scorer, first_rows[source], "") if name not in names]
    table = torch.zeros(len(rows), len(names), dtype=torch.float64, device=dist.device)
    for i, record in zip(mine, records if dist.tp_rank == 0 else []):
        table[i] = torch.tensor([record.get(name, math.nan) for name in names], dtype=torch.float64)
    table = dist.all_reduce_sum(table).cpu()  # each row is filled by exactly one rank
    values = {name: table[:, k].tolist() for k, name in enumerate(names)}
    return {"count": len(rows), "values": values, "means": {k: mean_interval(v) for k, v in values.items()},
            "records": records}


def summarize(result: dict) -> dict[str, float]:
    """evaluate()'s result for metrics.jsonl: eval/<metric> (the mean), eval/<metric>_low, _high (95%), eval/count."""
    out = {"eval/count": float(result["count"])}
    for name, (mean, low, high) in result["means"].items():
        out.update({f"eval/{name}": mean, f"eval/{name}_low": low, f"eval/{name}_high": high})
    return out

