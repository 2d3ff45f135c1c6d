"""A model as the reward (reward.model): every completion's final answer judged by a verifier checkpoint, or any chat
model, with the verifier prompt (rewards/verifier.py): the row's question (its last prompt message), its ground
truth as the reference, the completion's `<answer>` block (the whole completion without one) as the candidate.
All completions of a scoring go to one greedy generate call on the judge's own transformers engine.

Reward 1.0 for a judgment that parses to A (correct), 0.0 for B or C; also 0.0, the documented low score, for a
judgment that does not parse (judge_unparsed) or was not finished within reward.model_timeout_s (judge_timeout).
Both are 0/1 components of the result: the step logs their rate as reward/judge_unparsed and reward/judge_timeout,
the held-out evaluation as eval/judge_unparsed and eval/judge_timeout; the judgment text goes to samples.jsonl."""
from __future__ import annotations

import json
from collections.abc import Sequence

from models.chat import render_prompt
from rewards.parsing import extract_block
from rewards.verifier import parse_judgment, verifier_prompt


def judge_prompt(row: dict, text: str) -> str:
    """The verifier prompt of one completion `text` of `row` (the module docstring's three fields)."""
    truth = row["reward_model"]["ground_truth"]
    answer = extract_block(text, "answer")
    return verifier_prompt(row["prompt"][-1]["content"], truth if isinstance(truth, str) else json.dumps(truth),
                           (text if answer is None else answer).strip())


def judgment_result(judgment: str, finish_reason: str) -> dict:
    """The reward of one judgment (the module docstring): score, correct, judge_unparsed, judge_timeout, judgment."""
    timed_out = finish_reason == "timeout"
    letter = None if timed_out else parse_judgment(judgment)
    score = float(letter == "A")
    return {"score": score, "correct": score, "judge_unparsed": float(letter is None and not timed_out),
            "judge_timeout": float(timed_out), "judgment": judgment}


class Judge:
    """Scores completions of rows with a judge model on `engine` (rollout.hf_engine.HFEngine) and its `tokenizer`."""

    def __init__(self, engine, tokenizer, *, max_new_tokens: int, timeout_s: float | None = None):
        self.engine, self.tokenizer, self.max_new_tokens, self.timeout_s = engine, tokenizer, max_new_tokens, timeout_s

    def __call__(self, texts: Sequence[str], rows: Sequence[dict]) -> list[dict]:
        """judgment_result for each completion, all judged in one greedy generate call (deterministic)."""
        if not texts:  # a rank without held-out rows of its own
            return []
        prompts = [render_prompt(self.tokenizer, [{"role": "user", "content": judge_prompt(row, text)}])
                   for text, row in zip(texts, rows)]
        judgments = self.engine.generate(prompts, n=1, max_new_tokens=self.max_new_tokens, temperature=0.0, top_p=1.0,
                                         top_k=0, stop=[], seed=0, time_limit_s=self.timeout_s)
        return [judgment_result(judgment.text, judgment.finish_reason) for judgment in judgments]
