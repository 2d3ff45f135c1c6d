"""RLOO and REINFORCE++ equal verl's own functions on seeded random batches (tests/golden/verl_advantages.json,
written by tests/golden/verl_advantages.py in a side environment with verl: CI has none)."""
import json
import pathlib

import pytest
import torch

from grpo.advantages import compute_advantages

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "verl_advantages.json").read_text())
# float32: verl computes in float32, we whiten in float64, so they differ by float32 rounding (advantages of
# order 1). float64: verl's masked mean divides by count + 1e-8, a relative 1e-8 / count that moves the mean and
# variance by ~1e-10; 1e-8 stays far below any definitional difference (Bessel against population variance
# alone moves these advantages by ~1e-2).
ATOL = {"float32": 1e-6, "float64": 1e-8}


def test_golden_file_names_its_source():
    assert GOLDEN["verl_version"] == "0.9.1" and len(GOLDEN["cases"]) >= 4
    assert any(0 in case["lengths"] for case in GOLDEN["cases"])  # a filler group is covered


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda case: f"seed{case['seed']}-{case['dtype']}")
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_equals_verl(case, estimator):
    dtype = getattr(torch, case["dtype"])
    rewards = torch.tensor(case["rewards"], dtype=dtype)
    mask = (torch.arange(case["tokens"])[None, :] < torch.tensor(case["lengths"])[:, None]).to(dtype)
    weights = torch.tensor(case["weights"], dtype=dtype)
    ours = compute_advantages(estimator, rewards, torch.zeros_like(mask), mask, case["group_size"], weights=weights)
    expected = torch.tensor(case[estimator], dtype=dtype)
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL[case["dtype"]])
