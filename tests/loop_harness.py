"""Test-side parts for running grpo.trainer.train_rl directly: a scripted engine whose completions depend only
on the prompt (so every rank split samples the same texts), a log that keeps metrics in memory, checkpoints
that write nothing, and SGD in place of AdamW (see `sgd_policy`). Used by tests/test_loop_update.py (one
process) and tests/dist_invariance.py (2 ranks under torchrun), so both sides build their runs the same way.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from grpo.trainer import Policy
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

    def wake(self, tags=("weights", "kv_cache")):
        pass

    def update_weights(self, named_tensors):
        for _ in named_tensors:  # consumed, as the sync's sender expects (gathering FSDP shards is a collective)
            pass

    def close(self):
        pass


class MemoryLog:
    """grpo.trainer.Log that keeps each step's metrics (and warnings) in lists."""

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
    """grpo.trainer.Checkpoints that never stops early and writes nothing."""
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
    """parts with the scripted engine (in a copy of its LocalRollout), SGD at `lr`, an in-memory log and no
    checkpoints."""
    rollout = copy.copy(parts.rollout)
    rollout.engine = engine
    return dataclasses.replace(parts, rollout=rollout, policy=sgd_policy(parts.policy, lr), log=log or MemoryLog(),
                               checkpoints=NoCheckpoints())


# --- One RL step through launch.build + train_rl, the same on 1 process and under torchrun -------------------

ROWS = 8
# Each case: overrides for both sides; "{P}" / "{MINI}" are filled per world size so that 2 ranks x P
# prompts see exactly what 1 rank x 2P does (the sampler strides one shuffle over the ranks: rank r reads
# positions r, r + 2, ..., so the 2 ranks' first P prompts are the 1 rank's first 2P, and their k-th
# mini-batches of one prompt make the 1 rank's k-th mini-batch of two).
CASES = {
    "plain": [],
    "batch_std": ["algorithm.adv_estimator=batch_std"],
    "sentences": ["reward.functions={tests_vowels: 'rewards_for_tests:vowel_sentences'}", "reward.sentence_coef=2.0",
                  "algorithm.agg=seq-mean-token-mean"],
    # Rows 0-3 in order: rows 0 and 2 have constant correctness (2's rewards still vary), so they are fillers.
    "dynamic": ["algorithm.dynamic_sampling=true", "algorithm.max_gen_batches=1", "data.shuffle=false"],
    "lora": ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8.0"],
    # 4 SGD steps in a row: at lr 0.5 some weights move by more than 1 and rounding grows to ~4e-6 even between
    # micro-batch sizes on one process; at 0.1 they move by 0.02 and agree to ~1e-7.
    "mini_batches": ["algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size={MINI}", "algorithm.kl_coef=0.05",
                     "algorithm.entropy_coef=0.01", "algorithm.clip_high=0.28", "optim.lr=0.1"],
    "gspo_kl_in_reward": ["trainer.steps=2", "algorithm.ratio_level=sequence", "algorithm.clip_low=3e-4",
                          "algorithm.clip_high=4e-4", "algorithm.agg=seq-mean-token-mean", "algorithm.kl_coef=0.1",
                          "algorithm.kl_in_reward=true", "algorithm.adv_estimator=batch_std"],
    "token_budget": ["trainer.max_tokens_per_micro_batch=128"],
    # REINFORCE++ whitens over every rank's tokens (one all-reduce); RLOO and CISPO are per group / per token.
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp", "reward.sentence_coef=0"],
    "rloo_cispo": ["algorithm.adv_estimator=rloo", "reward.sentence_coef=0", "algorithm.policy_loss=cispo",
                   "algorithm.ppo_epochs=2", "optim.lr=0.1"],
    # On-policy distillation with the starting model as the teacher: step 1's signal is exactly 0 (teacher =
    # student), step 2's pulls the once-updated student back towards it; sharded teacher passes on 2 ranks.
    "distill": ["trainer.steps=2", "algorithm.teacher={MODEL}", "algorithm.distill_coef=0.5"],
}
WORDS = ["idea", "xyz", "queue", "rst", "aeiou", "bcd"]


def texts_for(index: int, n: int) -> list[str]:
    """The n completions of training row `index`: uneven lengths and vowel fractions; every 4th row's are all
    vowel-free, so its group is flat (reward 0, never correct): a filler group under dynamic sampling."""
    if index % 4 == 0:
        return [" ".join(["xyz"] * (k + 1)) for k in range(n)]
    return [" ".join(WORDS[(index + k + j) % len(WORDS)] for j in range(1 + (index + 2 * k) % 5)) for k in range(n)]


def write_rows(path) -> None:
    from data.rows import write_rows as write
    write([{"prompt": [{"role": "user", "content": f"Tell me about {i}."}], "data_source": "tests_vowels",
            "reward_model": {"ground_truth": "{}"}, "extra_info": {"index": i}} for i in range(ROWS)], path)


def case_overrides(case: str, world_size: int, model_dir, rows_path, out_dir, *extra: str) -> list[str]:
    """The full override list of `case` at this world size: 4 prompts x G = 4 per step in all."""
    fill = {"{P}": str(4 // world_size), "{MINI}": "2", "{MODEL}": str(model_dir)}  # MINI: prompts over all ranks
    overrides = [f"model.name_or_path={model_dir}", f"data.train_files=['{rows_path}']",
                 "reward.functions={tests_vowels: 'rewards_for_tests:vowel_fraction'}", "rollout.n=4",
                 "rollout.max_new_tokens=16", "trainer.prompts_per_step={P}", "trainer.steps=1",
                 f"trainer.micro_batch_size={2 if world_size > 1 else 8}", "optim.grad_clip=0", "optim.lr=0.5",
                 f"trainer.out_dir={out_dir}", f"trainer.run_name={case}_{world_size}", *CASES[case], *extra]
    for key, value in fill.items():
        overrides = [o.replace(key, value) for o in overrides]
    return overrides


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir: str):
    from models import load_tokenizer
    return load_tokenizer(model_dir)  # ~1 s each time: loaded once per process


def run_case(overrides: list[str], dist) -> tuple[dict, list]:
    """Build the run (launch.build), swap in the scripted engine, SGD (lr = optim.lr) and no checkpoints, run
    train_rl; returns (the full state dict: a collective, every rank calls it; the logged metrics)."""
    from grpo.trainer import train_rl
    from launch.build import build
    from launch.recipe import load_config
    from models import fsdp

    cfg = load_config(None, overrides)
    built = build(cfg, dist)
    tokenizer = _tokenizer(str(cfg.model.name_or_path))
    index_of = {tuple(ids): i for i, ids in enumerate(built.parts.rollout.prompt_ids)}

    def script(prompt):
        texts = texts_for(index_of[tuple(prompt)], cfg.rollout.n)
        return [(tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id], t) for t in texts]

    log = MemoryLog()
    parts = scripted_parts(built.parts, ScriptedEngine(script), lr=cfg.optim.lr, log=log)
    train_rl(parts, dist)
    built.log.close()
    weights = {name: tensor.clone() for name, tensor in fsdp.full_state_dict(parts.policy.model)}
    return weights, [metrics for _, metrics in log.steps]
