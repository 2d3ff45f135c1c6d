"""The rollout phase behind one seam (`Rollout`): LocalRollout generates on this rank's own engine (colocated, and
each engine rank of rollout.placement=separate); launch/separate.py's RemoteRollout receives its batches.

Scoring (`Scorer`) is here too: the one place a completion becomes a reward, a 0/1 correctness, a format success
and per-token sentence shaping, with the reward registry, for training and held-out evaluation (grpo/evaluate.py)
alike. A reward function that fails raises with the row named: it never becomes a 0 that looks like a judgement
(docs/conventions.md)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from grpo.advantages import keep_groups
from grpo.alignment import sentence_shaping, token_char_spans, token_sentence_index
from grpo.config import Config
from rollout.engine import stream_seed
from rollout.sync import sync_weights
from rollout.tools import Tools


class PromptSampler:
    """Seeded epoch-wise shuffling of row indices; each replica reads its own stride (whole groups per rank, so
    advantages need no collective). `position` (prompts consumed) is all the state a resumed run needs."""

    def __init__(self, num_rows: int, *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if num_rows < world_size:
            raise ValueError(f"{num_rows} training rows cannot feed {world_size} ranks")
        self.num_rows, self.seed, self.rank, self.world_size, self.shuffle = num_rows, seed, rank, world_size, shuffle
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        return torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next(self, count: int) -> list[int]:
        per_epoch, start = self.num_rows // self.world_size, self.position
        self.position += count
        return [self._order(p // per_epoch)[p % per_epoch * self.world_size + self.rank]
                for p in range(start, self.position)]


CORRECTNESS_KEYS = ("acc", "correct", "answer")  # first component found is the 0/1 correctness


def correctness(result: dict, score: float, threshold: float) -> float:
    """1.0 when the first of CORRECTNESS_KEYS in `result` (else the score) is at least `threshold`, else 0.0."""
    value = next((result[key] for key in CORRECTNESS_KEYS if key in result), score)
    return float(float(value) >= threshold)


def numeric_components(result: dict) -> dict[str, float]:
    """The reward's numeric components besides its score ("format", "evidence", ...), as floats."""
    return {key: float(value) for key, value in result.items()
            if key not in ("score", "sentences") and isinstance(value, (int, float, bool))}


def format_success(result: dict) -> float:
    """The one definition of format success: 1.0 when the reward's `format` component is 1 (every block the
    protocol asks for is there), 0.0 below, NaN when the reward has no format component (rates skip NaN)."""
    value = result.get("format")
    return math.nan if value is None else float(float(value) >= 1.0)


@dataclass
class Scores:
    """B scored completions."""
    rewards: Tensor  # [B] float32, the outcome reward (score)
    correct: Tensor  # [B] float32 0/1
    token_shaping: Tensor  # [B, T] float32 sentence shaping (zeros without sentence rewards), T = longest completion
    components: dict[str, list[float]] = field(default_factory=dict)  # each B floats, NaN where a reward lacks it


@dataclass(frozen=True)
class Scorer:
    """Everything scoring needs besides the completions. compute_scores (launch/reward_pool.py), when given, scores
    many calls at once: one outcome per call, its result, its exception, or None for a call not made after a failure."""
    compute_score: Callable
    decode_prefixes: Callable[[Sequence[int]], list[str]]  # ids -> [decode(ids[:k]) for k in 0..len(ids)]
    sentence_coef: float = 1.0
    correct_threshold: float = 0.5
    compute_scores: Callable[[list[tuple]], list] | None = None

    @staticmethod
    def _call(row: dict, text: str) -> tuple:
        """compute_score's arguments (verl's signature)."""
        return row["data_source"], text, row.get("reward_model", {}).get("ground_truth"), row.get("extra_info")

    @staticmethod
    def _checked(outcome, row: dict, position: int) -> dict:
        """The reward's result as a dict with a float "score"; an error raised with the row named."""
        if isinstance(outcome, BaseException):
            index = (row.get("extra_info") or {}).get("index")
            which = f"row index {index}" if index is not None else f"completion {position} of the batch (no index)"
            raise RuntimeError(f"reward {row.get('data_source')!r} failed on {which}: {outcome}") from outcome
        result = dict(outcome) if isinstance(outcome, dict) else {"score": float(outcome)}
        result["score"] = float(result["score"])
        return result

    def result(self, row: dict, text: str, position: int = 0) -> dict:
        """The reward function's result for one completion of `row`, always a dict with a float "score"."""
        try:
            outcome = self.compute_score(*self._call(row, text))
        except Exception as error:
            outcome = error
        return self._checked(outcome, row, position)

    def results(self, texts: Sequence[str], rows: Sequence[dict]) -> list[dict]:
        """result() for each completion, all at once through compute_scores when given; the first failure raises."""
        if self.compute_scores is None:
            return [self.result(row, text, b) for b, (text, row) in enumerate(zip(texts, rows))]
        outcomes = self.compute_scores([self._call(row, text) for text, row in zip(texts, rows)])
        for b, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                self._checked(outcome, rows[b], b)
        return [self._checked(outcome, row, b) for b, (outcome, row) in enumerate(zip(outcomes, rows))]

    def score(self, texts: Sequence[str], completion_ids: Sequence[Sequence[int]], rows: Sequence[dict]) -> Scores:
        """B completions and their rows, scored: token_shaping[b, t] = sentence_coef * r_sent(t's sentence), else 0."""
        results = self.results(texts, rows)
        token_shaping = torch.zeros(len(texts), max((len(ids) for ids in completion_ids), default=0))
        for b, (ids, result) in enumerate(zip(completion_ids, results)):
            if sentences := result.get("sentences"):
                index = token_sentence_index(token_char_spans(self.decode_prefixes(ids)),
                                             [(start, end) for start, end, _ in sentences])
                token_shaping[b, : len(ids)] = sentence_shaping(index, [r for _, _, r in sentences], self.sentence_coef)
        numeric = [numeric_components(result) for result in results]
        keys = dict.fromkeys(key for values in numeric for key in values)  # in order of first appearance
        correct = [correctness(result, result["score"], self.correct_threshold) for result in results]
        return Scores(torch.tensor([result["score"] for result in results], dtype=torch.float32),
                      torch.tensor(correct, dtype=torch.float32), token_shaping,
                      {key: [values.get(key, math.nan) for values in numeric] for key in keys})


@dataclass
class Group:
    """The G completions of one prompt, scored."""
    completions: list  # G rollout.engine.Completion
    rows: list[dict]  # G times the prompt's row
    rewards: Tensor  # [G]
    correct: Tensor  # [G]
    token_shaping: Tensor  # [G, T_g] sentence shaping (zeros without sentence rewards)
    components: dict[str, list[float]]  # each G values


@dataclass
class Batch:
    """B = P * G completions of P prompts (a prompt's G completions consecutive), ready for the update."""
    completions: list
    rows: list[dict]
    rewards: Tensor  # [B] outcome rewards
    correct: Tensor  # [B] 0/1
    lengths: Tensor  # [B] completion lengths in the model's tokens (float32; tool messages not counted)
    loss_weight: Tensor  # [B] 1, or 0 for filler groups that must not train (dynamic sampling)
    mask: Tensor  # [B, T] completion tokens times loss_weight: what the loss trains on
    token_shaping: Tensor  # [B, T] sentence shaping
    components: dict[str, list[float]]
    rounds: int  # generation rounds it took (dynamic sampling: up to algorithm.max_gen_batches)
    policy_version: int = 0  # optimizer steps of the weights that generated it (staleness: the step minus this)

    @classmethod
    def from_groups(cls, groups: Sequence[Group], weights: Sequence[float], *, rounds: int) -> Batch:
        completions = [c for g in groups for c in g.completions]
        width = max((len(c.completion_ids) for c in completions), default=0)
        loss_weight = torch.tensor([w for g, w in zip(groups, weights) for _ in g.completions], dtype=torch.float32)
        # The model's tokens: a completion's ids, less the tool messages of a multi-turn trajectory (rollout/tools.py).
        mask = torch.tensor([(c.mask if c.mask is not None else [1] * len(c.completion_ids))
                             + [0] * (width - len(c.completion_ids)) for c in completions], dtype=torch.float32)
        lengths = mask.sum(dim=1)
        mask = mask * loss_weight[:, None]
        token_shaping = torch.cat([torch.nn.functional.pad(g.token_shaping, (0, width - g.token_shaping.shape[1]))
                                   for g in groups])
        components: dict[str, list[float]] = {}
        for group in groups:
            for key, values in group.components.items():
                components.setdefault(key, []).extend(values)
        return cls(completions=completions, rows=[r for g in groups for r in g.rows],
                   rewards=torch.cat([g.rewards for g in groups]), correct=torch.cat([g.correct for g in groups]),
                   lengths=lengths, loss_weight=loss_weight, mask=mask, token_shaping=token_shaping,
                   components=components, rounds=rounds)


class Rollout(Protocol):
    """What the loops need from the rollout: a step's batch, the weights pushed after an update, and the held-out
    evaluation with the weights of `step` optimizer steps (grpo.evaluate.evaluate's result; None without rows)."""

    def collect(self, step: int) -> Batch: ...
    def sync_weights(self) -> dict: ...
    def evaluate(self, step: int) -> dict | None: ...
    def close(self, stop_signal: int = 0) -> None: ...


class LocalRollout:
    """A rank's rollout on its own engine. policy: the model sync_weights pushes into the engine; None when the
    engine generates with the policy module itself or receives its weights by broadcast (placement=separate)."""

    def __init__(self, cfg: Config, engine, scorer: Scorer, dist, *, rows: Sequence[dict],
                 prompt_ids: Sequence[list[int]], eval_rows: Sequence[dict] = (),
                 eval_prompt_ids: Sequence[list[int]] = (), policy: torch.nn.Module | None = None,
                 tools: Tools | None = None):
        self.cfg, self.engine, self.scorer, self.dist, self.policy = cfg, engine, scorer, dist, policy
        self.tools = tools  # rollout.tools.Tools: multi-turn rollouts where rollout.tools names tools
        self.rows, self.prompt_ids, self.eval_rows, self.eval_prompt_ids = rows, prompt_ids, eval_rows, eval_prompt_ids
        # One order over the rows per replica: the ranks of a tensor-parallel replica draw the same prompts.
        self.sampler = PromptSampler(len(rows), seed=cfg.seed, rank=dist.dp_rank, world_size=dist.dp_size,
                                     shuffle=cfg.data.shuffle) if rows else None

    def collect(self, step: int) -> Batch:
        """This rank's P prompts x G completions of step `step`, scored; then the engine sleeps for the update."""
        shares = self.collect_shares(stream_seed(self.cfg.seed, step, self.dist.dp_rank), self.dist.tp_size)
        batch = shares[self.dist.tp_rank]
        batch.policy_version = step
        self.engine.sleep()
        return batch

    def generate_groups(self, indices: Sequence[int], seed: int) -> list[Group]:
        """G scored completions for each of the prompts `indices`, one Group per prompt, in order."""
        roll, group_size = self.cfg.rollout, self.cfg.rollout.n
        prompts, rows = [self.prompt_ids[i] for i in indices], [self.rows[i] for i in indices]
        request = dict(n=group_size, seed=seed, max_new_tokens=roll.max_new_tokens, temperature=roll.temperature,
                       top_p=roll.top_p, top_k=roll.top_k, stop=list(roll.stop))
        completions = (self.engine.generate(prompts, **request) if self.tools is None
                       else self.tools.generate(self.engine, prompts, rows, **request))
        batch_rows = [self.rows[i] for i in indices for _ in range(group_size)]
        scores = self.scorer.score([c.text for c in completions], [c.completion_ids for c in completions], batch_rows)
        spans = [slice(p * group_size, (p + 1) * group_size) for p in range(len(indices))]
        return [Group(completions[span], batch_rows[span], scores.rewards[span], scores.correct[span],
                      scores.token_shaping[span, :max(len(c.completion_ids) for c in completions[span])],
                      {k: v[span] for k, v in scores.components.items()}) for span in spans]

    def collect_shares(self, seed: int, shares: int) -> list[Batch]:
        """Generate and score until `shares` batches of P = trainer.prompts_per_step groups are full (the ranks of a
        tensor-parallel replica, each with the same sampler state and seed as vLLM needs, or the trainers an engine
        rank serves). Dynamic sampling (DAPO) keeps only groups whose correctness varies; batches still short after
        algorithm.max_gen_batches rounds are filled with dropped groups of loss weight 0 (every rank runs as many
        micro-batches, as FSDP needs). Round r > 0 generates with stream_seed(seed, r): no stream is reused."""
        algo, num_prompts = self.cfg.algorithm, self.cfg.trainer.prompts_per_step
        wanted, kept, dropped, rounds = shares * num_prompts, [], [], 0
        while len(kept) < wanted and rounds < (algo.max_gen_batches if algo.dynamic_sampling else 1):
            groups = self.generate_groups(self.sampler.next(wanted), seed if rounds == 0 else stream_seed(seed, rounds))
            informative = keep_groups(torch.cat([g.correct for g in groups]), self.cfg.rollout.n)
            for group, keep in zip(groups, informative.tolist()):
                (kept if keep or not algo.dynamic_sampling else dropped).append(group)
            rounds += 1
        chosen = kept[:wanted]
        weights = [1.0] * len(chosen) + [0.0] * (wanted - len(chosen))
        chosen += dropped[: wanted - len(chosen)]
        return [Batch.from_groups(chosen[index:index + num_prompts], weights[index:index + num_prompts], rounds=rounds)
                for index in range(0, wanted, num_prompts)]

    def sync_weights(self) -> dict:
        """Push the policy's weights into the engine (rollout.sync.sync_weights); {} when it shares them."""
        if self.policy is None:
            return {}
        return sync_weights(self.policy, self.engine, bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20,
                            dtype=getattr(torch, self.cfg.model.param_dtype))  # the engine's (launch.plan.precision)

    def evaluate(self, step: int) -> dict | None:
        """The held-out rows scored greedily with the engine's current weights (the same rows after every step)."""
        from grpo.evaluate import evaluate  # grpo.evaluate imports this module (Scorer)
        if not self.eval_rows:
            return None
        return evaluate(self.engine, self.scorer, self.eval_rows, self.eval_prompt_ids, self.dist,
                        max_new_tokens=self.cfg.eval_max_new_tokens, batch_size=self.cfg.trainer.eval_batch_size,
                        tools=self.tools)

    def close(self, stop_signal: int = 0) -> None:
        self.engine.close()
