"""The reward of the arithmetic tool task (data/arithmetic.py): the last `<answer>N</answer>` of the trajectory
against the ground truth, an integer. Only the model's final answer counts: a tool message never holds the tag."""
from __future__ import annotations

import re

ANSWER = re.compile(r"<answer>\s*(-?\d[\d,]*)\s*</answer>")


def arithmetic_reward(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """{"score": 1.0 when the last answer equals the ground truth, else 0.0, "format": 1.0 when there is an
    answer, "acc": the score}. A ground truth that is not an integer raises (int's ValueError shows it)."""
    expected = int(str(ground_truth).strip())
    answers = ANSWER.findall(solution_str)
    correct = float(bool(answers) and int(answers[-1].replace(",", "")) == expected)
    return {"score": correct, "format": float(bool(answers)), "acc": correct}
