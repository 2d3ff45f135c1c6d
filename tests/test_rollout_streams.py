"""Every completion of a run samples from its own random stream: the trainer names each generate call by (run
seed, step, replica, round) through a hash, and the vLLM engine gives each prompt of a call a stream whose
children (vLLM adds a completion's index to the seed) cannot meet another prompt's. Tested on the names of a long
run and through train_rl with a recording engine; tests/test_rollout_engines.py checks the engines themselves."""
from __future__ import annotations

import itertools

import torch

from grpo.groups import LocalRollout, Scorer
from grpo.trainer import Parts, Policy, train_rl
from launch.dist import DistInfo
from launch.recipe import load_config
from loop_harness import MemoryLog, NoCheckpoints, sgd_policy
from rollout.engine import CHILD_BITS, Completion, prompt_seed, stream_seed
from test_loop_update import ConstantPolicy, LETTERS


def test_the_streams_of_a_long_run_are_all_distinct():
    # 2 run seeds x 500 steps x 8 replicas x 4 dynamic-sampling rounds, 16 prompts per call, G = 64.
    calls = {stream_seed(stream_seed(seed, step, replica), rounds) if rounds else stream_seed(seed, step, replica)
             for seed, step, replica, rounds in itertools.product(range(2), range(500), range(8), range(4))}
    assert len(calls) == 2 * 500 * 8 * 4 and all(0 <= c < 2**63 for c in calls)
    prompts = [prompt_seed(call, index) for call in calls for index in range(16)]
    # A prompt's children are its seed + i, i < 64 <= 2^16: disjoint ranges when the high bits differ.
    assert all(seed % (1 << CHILD_BITS) == 0 for seed in prompts)
    assert len({seed >> CHILD_BITS for seed in prompts}) == len(prompts)


class RecordingEngine:
    """Answers every prompt with G completions alternating "a"/"b" (flat groups on even rounds, so dynamic
    sampling needs a second round), recording each call's seed and prompts."""

    def __init__(self):
        self.requests = []

    def generate(self, prompts, *, n, seed=None, **sampling):
        self.requests.append((seed, [list(p) for p in prompts]))
        flat = len(self.requests) % 2 == 1
        return [Completion(prompt_ids=list(p), completion_ids=[0 if flat or k % 2 == 0 else 1],
                           text="a" if flat or k % 2 == 0 else "b", logprobs=[-1.0], finish_reason="stop")
                for p in prompts for k in range(n)]

    def sleep(self):
        pass


def _train(dist, engine, *overrides, log=None):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "toy",
             "reward_model": {"ground_truth": "a"}, "extra_info": {"index": i}} for i in range(8)]
    cfg = load_config(None, ["rollout.n=2", "rollout.max_new_tokens=1", "trainer.prompts_per_step=2",
                             "trainer.steps=3", "seed=3", *overrides])
    model = ConstantPolicy([0.0, 0.0, 0.0])
    decode = lambda ids: ["".join(LETTERS[i] for i in ids[:k]) for k in range(len(ids) + 1)]  # noqa: E731
    exact = lambda source, text, truth, extra=None: float(text == truth)  # noqa: E731
    rollout = LocalRollout(cfg, engine, Scorer(exact, decode), dist, rows=rows, prompt_ids=[[i % 3] for i in range(8)])
    parts = Parts(cfg=cfg, policy=sgd_policy(Policy(model, torch.optim.SGD(model.parameters(), lr=0.0), None), lr=0.1),
                  rollout=rollout, log=log or MemoryLog(), checkpoints=NoCheckpoints(), pad_id=0)
    train_rl(parts, dist)
    return engine.requests


def test_no_step_round_or_replica_reuses_a_call_seed():
    seeds = []
    for rank in range(2):  # two data-parallel replicas (the collectives of this fake world are identities)
        requests = _train(DistInfo(rank=rank, world_size=2), RecordingEngine(), "algorithm.dynamic_sampling=true",
                          "algorithm.max_gen_batches=2")
        assert len(requests) == 6  # 3 steps x 2 rounds (round 0's groups are all flat)
        seeds += [seed for seed, _ in requests]
    assert len(set(seeds)) == len(seeds) == 12
    # The same run again asks for the same seeds: resume stays exact.
    again = _train(DistInfo(rank=1, world_size=2), RecordingEngine(), "algorithm.dynamic_sampling=true",
                   "algorithm.max_gen_batches=2")
    assert [seed for seed, _ in again] == seeds[6:]


class SampleLog(MemoryLog):
    def __init__(self):
        super().__init__()
        self.prompts = []

    def samples(self, step, samples):
        self.prompts.append(samples[0]["prompt"])


def _train_logged(dist, *overrides):
    engine, log = RecordingEngine(), SampleLog()
    _train(dist, engine, *overrides, log=log)
    return engine.requests, log.prompts


def test_tensor_parallel_peers_submit_the_same_requests_and_train_on_their_own_shares():
    # vLLM's external launcher needs every rank of a replica to submit identical requests. Ranks 0 and 1 of one
    # TP-2 replica: the same seeds and the replica's 2 x 2 prompts; each trains on its own 2 groups of them.
    peers = [_train_logged(DistInfo(rank=rank, world_size=2, tp_size=2)) for rank in range(2)]
    (requests0, trained0), (requests1, trained1) = peers
    assert requests0 == requests1 and all(len(prompts) == 4 for _, prompts in requests0)
    assert all(a != b for a, b in zip(trained0, trained1))  # the first group of each rank's share differs
    # Two TP-1 replicas instead: each its own 2 prompts and its own seeds.
    (alone0, _), (alone1, _) = [_train_logged(DistInfo(rank=rank, world_size=2)) for rank in range(2)]
    assert all(len(prompts) == 2 for _, prompts in alone0)
    assert all(s0 != s1 for (s0, _), (s1, _) in zip(alone0, alone1))
