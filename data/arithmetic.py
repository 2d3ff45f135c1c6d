"""A generated arithmetic task for tool use: `python -m data.arithmetic --n 200 --seed 0 --out FILE`.

Word problems whose answer is a * b +- c (a, c three digits, b two): a 135M model cannot multiply that in its head
and can with the calculator (rollout/tools.py). The SFT target is a tool user's trajectory: the call, the answer,
then `<answer>N</answer>` (the reward `arithmetic` scores the last answer)."""
from __future__ import annotations

import json
import random

from data.synthetic import main

SYSTEM = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "..."}}</tool_call> and wait for its answer. End with the result as <answer>N</answer>.')
# (question, sign of c): a, b, c fill the question; the answer is a * b + sign * c.
PROBLEMS = (
    ("A warehouse holds {a} boxes of {b} bottles each and {c} loose bottles. How many bottles are there?", 1),
    ("A farm packs {a} crates of {b} apples each, then sells {c} apples. How many apples are left?", -1),
    ("A school orders {a} packs of {b} pencils each and {c} single pencils. How many pencils is that?", 1),
    ("A library has {a} shelves of {b} books each and lends out {c} books. How many books stay?", -1),
)


def generate_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`n` rows in the verl layout (data_source "arithmetic"); same seed, same rows."""
    rng, rows = random.Random(seed), []
    for index in range(n):
        question, sign = rng.choice(PROBLEMS)
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
        expression, answer = f"{a} * {b} {'+' if sign > 0 else '-'} {c}", a * b + sign * c
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        target = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                  {"role": "tool", "content": str(answer)},
                  {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
        rows.append({"prompt": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": question.format(a=a, b=b, c=c)}],
                     "data_source": "arithmetic", "ability": "math", "reward_model": {"ground_truth": str(answer)},
                     "extra_info": {"index": index, "split": split, "target": target, "generator_seed": seed}})
    return rows


if __name__ == "__main__":
    main(generate=generate_rows, module="data.arithmetic", description=__doc__)
