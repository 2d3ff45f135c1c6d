"""Test-side parts for running grpo.trainer.train_rl directly: a scripted engine whose completions depend only
on the prompt (so every rank split samples the same texts), a log that keeps metrics in memory, checkpoints
that write nothing, and SGD in place of AdamW (see `sgd_policy`). Used by tests/test_loop_update.py (one
process) and tests/dist_invariance.py (2 ranks under torchrun), so both sides build their runs the same way.
"""
from __future__ import annotations

import dataclasses

import torch

from grpo.parts import Policy
from rollout.engine import Completion


class ScriptedEngine:
    """generate() answers each prompt with script(prompt_ids) -> n (completion ids, text) pairs, whatever the
    seed, rank or batch it comes in; the rollout logprob of every token is -1. sleep/wake do nothing."""

    def __init__(self, script):
        self.script, self.calls = script, 0

    def generate(self, prompts, *, n, seed=None, **sampling):
        self.calls += 1
        out = []
        for prompt in prompts:
            answers = self.script(list(prompt))
            assert len(answers) == n, (len(answers), n)
            out += [Completion(prompt_ids=list(prompt), completion_ids=list(ids), text=text,
                               logprobs=[-1.0] * len(ids), finish_reason="stop") for ids, text in answers]
        return out

    def sleep(self):
        pass

    def wake(self):
        pass


class MemoryLog:
    """grpo.parts.Log that keeps each step's metrics (and warnings) in lists."""

    def __init__(self):
        self.steps, self.warnings = [], []

    def metrics(self, step, metrics, postfix_keys=()):
        self.steps.append((step, dict(metrics)))

    def samples(self, step, samples):
        pass

    def warn(self, message):
        self.warnings.append(message)

    def info(self, message):
        pass


class NoCheckpoints:
    """grpo.parts.Checkpoints that never stops early and writes nothing."""
    start_step = 0

    def end_step(self, done):
        return False

    def finish(self):
        pass


def sgd_policy(policy: Policy, lr: float) -> Policy:
    """The same model with plain SGD (no momentum) at a constant learning rate.

    Why not the run's AdamW: its first step is lr * g / (|g| + eps), about lr * sign(g), which hides a wrong
    gradient scale (a gradient twice too large gives the same step) and turns rounding noise into steps of up
    to lr where |g| is near eps. With SGD the weights move by exactly -lr * g, so comparing weights after a
    step compares gradients."""
    optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=lr)
    return Policy(policy.model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def scripted_parts(parts, engine, *, lr: float, log=None):
    """parts with the scripted engine, SGD at `lr`, an in-memory log and no checkpoints."""
    return dataclasses.replace(parts, engine=engine, policy=sgd_policy(parts.policy, lr), log=log or MemoryLog(),
                               checkpoints=NoCheckpoints())
