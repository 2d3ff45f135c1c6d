"""Writes tests/golden/verl_advantages.json: verl's own RLOO and REINFORCE++ outcome advantages
(compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage with gamma = 1) on seeded random
batches, which tests/test_math_verl_golden.py recomputes with grpo.advantages. CI has no verl; regenerate by hand
in a side virtual environment that has it (the CPU torch wheel, verl without its dependencies, and the few small
packages its core_algos module imports):

    python3.11 -m venv /tmp/venv-verl && /tmp/venv-verl/bin/pip install torch==2.13.0
    /tmp/venv-verl/bin/pip install --no-deps verl
    /tmp/venv-verl/bin/pip install packaging numpy ray tensordict omegaconf transformers codetiming orjson
    /tmp/venv-verl/bin/python tests/golden/verl_advantages.py

Each batch has P groups of G completions of uneven lengths (right-padded, at least one token), rewards that are
continuous, binary or with a flat group, in float32 (the trainer's dtype) and float64; one batch ends with a
filler group of dynamic sampling (mask 0, weight 0). verl puts an outcome reward on the last real token of its
token-level rewards; a filler row has none. verl is imported only inside main(): pytest imports this module for
its doctests.
"""
from __future__ import annotations

import json
import pathlib

OUT = pathlib.Path(__file__).with_name("verl_advantages.json")
# (seed, prompts, group size, tokens, rewards, dtype, filler group at the end)
CASES = [
    (0, 3, 4, 7, "continuous", "float32", False),
    (1, 4, 2, 5, "binary", "float32", False),
    (2, 3, 5, 9, "flat_group", "float32", True),
    (3, 3, 4, 7, "continuous", "float64", False),
    (4, 2, 3, 6, "binary", "float64", True),
]


def make_batch(seed: int, prompts: int, group_size: int, tokens: int, kind: str, dtype: str, filler: bool) -> dict:
    """The inputs of one case as plain lists: rewards [B], lengths [B] (0 for a filler row), weights [B]."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    size = prompts * group_size
    torch_dtype = getattr(torch, dtype)
    if kind == "continuous":
        rewards = torch.randn(size, generator=gen, dtype=torch.float64)
    else:
        rewards = (torch.rand(size, generator=gen, dtype=torch.float64) > 0.5).to(torch.float64)
    if kind == "flat_group":
        rewards[:group_size] = 0.7
    rewards = rewards.to(torch_dtype)
    lengths = torch.randint(1, tokens + 1, (size,), generator=gen)
    weights = torch.ones(size)
    if filler:
        lengths[-group_size:] = 0
        weights[-group_size:] = 0
    return {"seed": seed, "group_size": group_size, "tokens": tokens, "rewards_kind": kind, "dtype": dtype,
            "rewards": rewards.tolist(), "lengths": lengths.tolist(), "weights": weights.tolist()}


def main() -> None:
    import numpy as np
    import torch
    import verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    cases = []
    for spec in CASES:
        case = make_batch(*spec)
        dtype = getattr(torch, case["dtype"])
        rewards = torch.tensor(case["rewards"], dtype=dtype)
        lengths = torch.tensor(case["lengths"])
        mask = (torch.arange(case["tokens"])[None, :] < lengths[:, None]).to(dtype)
        token_rewards = torch.zeros_like(mask)
        real = lengths > 0
        token_rewards[real.nonzero().squeeze(1), lengths[real] - 1] = rewards[real]  # outcome at the last real token
        index = np.array([b // case["group_size"] for b in range(len(rewards))])
        rloo, _ = core_algos.compute_rloo_outcome_advantage(token_rewards.clone(), mask, index)
        reinforce_pp, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards.clone(), mask, config=AlgoConfig(gamma=1.0))
        case["rloo"] = rloo.tolist()
        case["reinforce_pp"] = reinforce_pp.tolist()
        cases.append(case)
    OUT.write_text(json.dumps({
        "what": "verl's compute_rloo_outcome_advantage and compute_reinforce_plus_plus_outcome_advantage (gamma 1) "
                "on seeded random batches; written by tests/golden/verl_advantages.py",
        "verl_version": verl.__version__,
        "torch_version": torch.__version__,
        "cases": cases,
    }, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases, verl {verl.__version__})")


if __name__ == "__main__":
    main()
