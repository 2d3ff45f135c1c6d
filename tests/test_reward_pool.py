"""Rewards scored in worker processes (launch/reward_pool.py, reward.num_workers): the scores equal serial scoring
exactly, a slow reward does not serialize a batch, a hung reward is abandoned (its worker killed and replaced) with
its row named, a worker that dies is a named error, and a reward the workers would not see is refused at start-up."""
import os
import re
import time

import pytest
import torch

import rewards
from grpo.config import ConfigError, RewardConfig
from grpo.groups import Scorer
from launch.reward_pool import RewardPool


def decode_prefixes(ids):
    """Token ids are code points here, so sentence spans come out exactly as in text."""
    return ["".join(map(chr, ids[:k])) for k in range(len(ids) + 1)]


@pytest.fixture
def pools():
    """Start pools for a test (registering their functions here first, as launch/preflight.py does); close them after."""
    started = []

    def start(functions: dict, *, num_workers: int = 2, timeout_s: float | None = None) -> RewardPool:
        for name, dotted in functions.items():
            rewards.register(name, rewards.get_reward(dotted), overwrite=True)
        pool = RewardPool(RewardConfig(functions=functions, num_workers=num_workers, timeout_s=timeout_s), list(functions))
        started.append(pool)
        pool.start()
        return pool

    yield start
    for pool in started:
        pool.close()


def _scorer(pool: RewardPool | None) -> Scorer:
    if pool is None:
        return Scorer(rewards.compute_score, decode_prefixes, sentence_coef=2.0)
    return Scorer(pool.compute_score, decode_prefixes, sentence_coef=2.0, compute_scores=pool.compute_scores)


def _row(data_source: str, index: int, ground_truth=None) -> dict:
    return {"data_source": data_source, "reward_model": {"ground_truth": ground_truth}, "extra_info": {"index": index}}


def test_pool_scores_equal_serial_scoring(pools):
    from data.synthetic import generate_rows
    texts, rows = [], []
    for row in generate_rows(6, seed=0):  # the evidence reward on its ideal answer and three damaged ones
        target = row["extra_info"]["target"]
        for text in (target, target[: len(target) // 2], "", target.replace("SUPPORTS", "REFUTES")):
            texts.append(text)
            rows.append(row)
    for index in range(6):  # a reward with sentence spans and other components (NaN where the other lacks them)
        texts.append(f"Some words about the number {index}. And then some more.")
        rows.append(_row("tests_pool_sentences", index))
    ids = [[ord(c) for c in text] for text in texts]
    pool = pools({"tests_pool_sentences": "rewards_for_tests:vowel_sentences"}, num_workers=3)
    serial, pooled = _scorer(None).score(texts, ids, rows), _scorer(pool).score(texts, ids, rows)
    assert torch.equal(serial.rewards, pooled.rewards) and torch.equal(serial.correct, pooled.correct)
    assert torch.equal(serial.token_shaping, pooled.token_shaping)
    nan_safe = lambda values: [value if value == value else "nan" for value in values]  # noqa: E731
    assert {k: nan_safe(v) for k, v in serial.components.items()} == {k: nan_safe(v) for k, v in pooled.components.items()}
    # Not a trivial batch: scores vary, sentences shape tokens, components are missing for some rows.
    assert serial.rewards.unique().numel() > 3 and serial.token_shaping.abs().sum() > 0
    assert any(value != value for values in serial.components.values() for value in values)


def test_slow_reward_does_not_serialize_the_batch(pools):
    pool = pools({"tests_pool_slow": "rewards_for_tests:vowels_slowly"}, num_workers=4)
    rows = [_row("tests_pool_slow", index) for index in range(8)]
    started = time.perf_counter()
    scores = _scorer(pool).score(["hello"] * 8, [[ord(c) for c in "hello"]] * 8, rows)
    elapsed = time.perf_counter() - started
    assert torch.equal(scores.rewards, torch.full((8,), 0.4))  # "hello": 2 vowels of 5 letters
    assert elapsed < 2.5, f"8 calls of 0.5 s on 4 workers took {elapsed:.1f} s (serially: 4 s)"


def test_hung_reward_is_abandoned_with_its_row_named(pools):
    pool = pools({"tests_pool_hang": "rewards_for_tests:hangs_on_row_5"}, timeout_s=1.0)
    rows = [_row("tests_pool_hang", index) for index in range(8)]
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"reward 'tests_pool_hang' failed on row index 5: no result within "
                                           r"reward\.timeout_s=1 s") as failure:
        _scorer(pool).score(["hello"] * 8, [[104]] * 8, rows)
    assert time.perf_counter() - started < 10
    pid = int(re.search(r"pid (\d+)", str(failure.value)).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung worker is gone, not left running
    assert pool.compute_score("tests_pool_hang", "hello", None, {"index": 1})["score"] == 0.4  # a new worker serves


def test_worker_crash_is_a_named_error(pools):
    pool = pools({"tests_pool_crash": "rewards_for_tests:dies_on_row_6"})
    rows = [_row("tests_pool_crash", index) for index in range(8)]
    with pytest.raises(RuntimeError, match=r"row index 6: reward worker pid \d+ died while scoring "
                                           r"\(exit code -9, SIGKILL\)"):
        _scorer(pool).score(["hello"] * 8, [[104]] * 8, rows)
    assert pool.compute_score("tests_pool_crash", "hello", None, {"index": 1})["score"] == 0.4


def test_reward_registered_in_code_is_refused_at_start_up():
    from launch.reward_pool import reward_functions
    builtin = rewards.get_reward("verifier")
    one_worker = RewardConfig(num_workers=1)
    try:  # a built-in name replaced in code: the workers would score with the built-in, silently
        rewards.register("verifier", lambda *args, **kwargs: 1.0, overwrite=True)
        with pytest.raises(ConfigError, match=r"data_source 'verifier' is .*<lambda> here but "
                                              r"rewards\.verifier\.verifier_reward in the reward workers"):
            reward_functions(one_worker, [_row("verifier", 0)])
    finally:
        rewards.register("verifier", builtin, overwrite=True)
    rewards.register("tests_pool_code_only", lambda *args, **kwargs: 1.0, overwrite=True)
    with pytest.raises(ConfigError, match=r"a reward worker could not set up the rewards: .*'tests_pool_code_only'"):
        reward_functions(one_worker, [_row("tests_pool_code_only", 0)])
