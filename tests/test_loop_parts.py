"""What decides what gets trained, tested directly: collecting groups (dynamic sampling, filler weights, per-rank
striding), scoring (correctness keys, format success, sentence shaping, failures), step metrics and their
reduction over ranks, held-out evaluation and its statistics. A ~20-line scripted engine stands in for the
model: the texts are chosen by the test, so every number below is known in advance."""
import math

import pytest
import torch

from grpo.evaluate import evaluate, greedy_completions, summarize
from grpo.groups import LocalRollout, PromptSampler, Scorer, correctness, format_success
from grpo.stats import mean_interval, paired_difference
from grpo.trainer import NoSignalWatch, held_out_due, reduce_metrics, step_metrics
from rollout.engine import Completion


class ScriptedEngine:
    """generate() answers prompt p with script[(p, call)] (a list of texts, one per sample), where `call`
    counts this engine's generate calls; token ids are the characters' code points."""

    def __init__(self, script):
        self.script, self.calls, self.requests = script, 0, []

    def generate(self, prompts, *, n, seed=None, **sampling):
        self.requests.append({"prompts": [list(p) for p in prompts], "n": n, "seed": seed, **sampling})
        out = []
        for prompt in prompts:
            texts = self.script[(prompt[0], self.calls)]
            assert len(texts) == n
            out += [Completion(prompt_ids=list(prompt), completion_ids=[ord(c) for c in text], text=text,
                               logprobs=[-1.0] * len(text), finish_reason="stop") for text in texts]
        self.calls += 1
        return out


def reward(data_source, text, ground_truth, extra_info=None):
    """'y' in the text is correct (answer 1) and worth 1; format is 1 when the text ends with '.'."""
    right = float("y" in text)
    return {"score": right, "answer": right, "format": float(text.endswith("."))}


ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "toy", "reward_model": {"ground_truth": ""},
         "extra_info": {"index": i}} for i in range(4)]
PROMPT_IDS = [[i] for i in range(4)]  # prompt i is the one token i: the script is keyed by it
SCORER = Scorer(reward, decode_prefixes=lambda ids: ["".join(map(chr, ids[:k])) for k in range(len(ids) + 1)])


def collect(engine, scorer=SCORER, *, seed: int, dynamic: bool = False, rounds: int = 1):
    """One batch of 2 prompts x G=2 from a LocalRollout reading the rows in order (a one-process DistInfo)."""
    from launch.dist import DistInfo
    from launch.recipe import load_config
    cfg = load_config(None, ["rollout.n=2", "trainer.prompts_per_step=2", "data.shuffle=false", "rollout.max_new_tokens=4",
                             f"algorithm.dynamic_sampling={dynamic}", f"algorithm.max_gen_batches={rounds}"])
    return LocalRollout(cfg, engine, scorer, DistInfo(), rows=ROWS, prompt_ids=PROMPT_IDS).collect_shares(seed, 1)[0]


def test_collect_groups_without_dynamic_sampling_keeps_every_group_in_prompt_order():
    engine = ScriptedEngine({(0, 0): ["y.", "n."], (1, 0): ["nn", "nnn"]})
    batch = collect(engine, seed=11)
    assert [c.text for c in batch.completions] == ["y.", "n.", "nn", "nnn"]
    assert [r["extra_info"]["index"] for r in batch.rows] == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and batch.correct.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert batch.loss_weight.tolist() == [1.0] * 4 and batch.rounds == 1
    # The mask is built once: completion tokens (lengths 2, 2, 2, 3) padded to the longest.
    assert batch.mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert batch.components["format"] == [1.0, 1.0, 0.0, 0.0]
    assert engine.requests[0]["seed"] == 11 and engine.requests[0]["n"] == 2


def test_dynamic_sampling_generates_until_full_then_fills_with_zero_weight_groups():
    # Round 0: prompt 0 informative, prompt 1 flat. Round 1 (its own seed): prompt 2 flat, prompt 3 informative.
    script = {(0, 0): ["y", "n"], (1, 0): ["n", "n"], (2, 1): ["y", "y"], (3, 1): ["n", "y"]}
    batch = collect(ScriptedEngine(script), seed=5, dynamic=True, rounds=3)
    assert [r["extra_info"]["index"] for r in batch.rows] == [0, 0, 3, 3]  # the two informative groups
    assert batch.loss_weight.tolist() == [1.0] * 4 and batch.rounds == 2
    # One round allowed: a single informative group, the batch filled with a dropped one that must not train.
    engine = ScriptedEngine(script)
    batch = collect(engine, seed=5, dynamic=True, rounds=1)
    assert [r["extra_info"]["index"] for r in batch.rows] == [0, 0, 1, 1]
    assert batch.loss_weight.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch.mask[2:].sum() == 0 and batch.mask[:2].sum() == 2
    assert [request["seed"] for request in engine.requests] == [5]


def test_sentence_shaping_is_one_padded_tensor_across_groups_of_different_widths():
    def with_sentences(data_source, text, ground_truth, extra_info=None):
        return {"score": 0.5, "sentences": [(0, min(2, len(text)), 0.1)] + ([(2, len(text), -0.3)] * (len(text) > 2))}

    scorer = Scorer(with_sentences, SCORER.decode_prefixes, sentence_coef=2.0)
    engine = ScriptedEngine({(0, 0): ["abc", "ab"], (1, 0): ["abcde", "a"]})
    batch = collect(engine, scorer, seed=0)
    expected = [[0.2, 0.2, -0.6, 0, 0], [0.2, 0.2, 0, 0, 0], [0.2, 0.2, -0.6, -0.6, -0.6], [0.2, 0, 0, 0, 0]]
    assert torch.allclose(batch.token_shaping, torch.tensor(expected), atol=1e-7)


def test_each_rank_reads_its_own_stride_of_one_shuffle():
    ranks = [PromptSampler(8, seed=3, rank=r, world_size=2) for r in range(2)]
    taken = [s.next(4) for s in ranks]
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    assert taken == [order[0::2], order[1::2]] and sorted(taken[0] + taken[1]) == list(range(8))
    assert ranks[0].next(1) == [torch.randperm(8, generator=torch.Generator().manual_seed(4)).tolist()[0]]


def test_scoring_correctness_order_format_and_failures():
    assert correctness({"score": 0.9, "acc": 0.0, "answer": 1.0}, 0.9, 0.5) == 0.0  # "acc" comes first
    assert correctness({"score": 0.9, "answer": 0.0}, 0.9, 0.5) == 0.0
    assert correctness({"score": 0.4}, 0.4, 0.5) == 0.0 and correctness({"score": 0.5}, 0.5, 0.5) == 1.0
    assert format_success({"format": 1.0}) == 1.0 and format_success({"format": 0.99}) == 0.0
    assert math.isnan(format_success({"score": 1.0}))

    def broken(*args):
        raise KeyError("index missing")

    with pytest.raises(RuntimeError, match="reward 'toy' failed on row index 2: 'index missing'"):
        Scorer(broken, SCORER.decode_prefixes).score(["x"], [[120]], [ROWS[2]])
    # A row without extra_info (verl allows it) is named by its place in the batch, not a crash on None.
    with pytest.raises(RuntimeError, match=r"reward 'toy' failed on completion 0 of the batch \(no index\)"):
        Scorer(broken, SCORER.decode_prefixes).score(["x"], [[120]], [{**ROWS[2], "extra_info": None}])
    scores = Scorer(lambda *a: 0.25, SCORER.decode_prefixes).score(["ab", "c"], [[97, 98], [99]], ROWS[:2])
    assert scores.rewards.tolist() == [0.25, 0.25] and scores.token_shaping.shape == (2, 2)
    assert scores.token_shaping.abs().sum() == 0 and scores.components == {}


def test_step_metrics_and_their_reduction_over_ranks():
    engine = ScriptedEngine({(0, 0): ["y.", "n."], (1, 0): ["nn", "nnn"]})
    batch = collect(engine, seed=0)
    updates = [{"ratio_mean": 1.0, "ratio_max": 1.5, "tokens": 4.0, "entropy": 2.0},
               {"ratio_mean": 1.2, "ratio_max": 2.0, "tokens": 5.0, "entropy": float("nan")}]
    metrics = step_metrics(batch, batch.rewards, 2, updates, {"rollout_reward": 1.0, "update": 1.0}, grad_norm=0.5,
                           lr=1e-6, skipped=0.0, sync_info={})
    assert metrics["flat_group_frac"] == 0.5 and metrics["format_rate"] == 0.5 and metrics["acc"] == 0.25
    assert metrics["ratio_first_update"] == 1.0 and metrics["ratio_max"] == 2.0 and metrics["entropy"] == 2.0
    assert metrics["trained_tokens"] == 9.0 and metrics["tokens_per_s"] == 4.5  # 9 completion tokens in 2 s
    assert metrics["response_length_max"] == 3.0 and metrics["reward/format"] == 0.5

    class TwoRanks:  # the other rank logged 0.0 for every mean key and 3.0 for every max key
        world_size, device = 2, torch.device("cpu")

        def all_reduce_sum(self, tensor):  # [values of the mean keys, 1 where present]: add the other rank's
            keys = len(tensor) // 2
            return tensor + torch.cat([torch.zeros(keys, dtype=tensor.dtype), torch.ones(keys, dtype=tensor.dtype)])

        def all_reduce_max(self, tensor):
            return torch.maximum(tensor, torch.full_like(tensor, 3.0))

    reduced = reduce_metrics(metrics, TwoRanks())
    assert reduced["acc"] == 0.125 and reduced["ratio_max"] == 3.0 and reduced["reward/format"] == 0.5
    # A rank that trained on no token (all its groups are dynamic-sampling fillers) has no ratio: NaN, which
    # the mean over ranks skips, so the other rank's ratio_first_update of 1 stands.
    filler = step_metrics(batch, batch.rewards, 2, [{"ratio_mean": 0.0, "ratio_max": 0.0, "tokens": 0.0}], {"update": 1.0},
                          grad_norm=0.5, lr=1e-6, skipped=0.0, sync_info={})
    assert math.isnan(filler["ratio_first_update"]) and math.isnan(filler["ratio_max"])

    class OtherRankTrained(TwoRanks):  # the other rank logged 1.0 for every mean key
        def all_reduce_sum(self, tensor):
            keys = len(tensor) // 2
            return tensor + torch.ones(2 * keys, dtype=tensor.dtype)

    assert reduce_metrics(filler, OtherRankTrained())["ratio_first_update"] == 1.0


def test_no_signal_warnings_need_a_streak():
    from launch.recipe import load_config
    watch = NoSignalWatch(load_config(None, ["trainer.warn_truncation=0.5", "trainer.warn_flat_groups=0.9",
                                             "trainer.warn_after_steps=2", "algorithm.kl_coef=0.0"]))
    assert watch.update({"flat_group_frac": 1.0, "truncation_rate": 0.0}, 1) == [
        "step 1: zero learning signal -- every group's rewards are identical"]
    second = watch.update({"flat_group_frac": 1.0, "truncation_rate": 0.6}, 2)
    assert len(second) == 2 and second[1].startswith("flat_group_frac = 1.00 > 0.9 for 2 steps")
    assert watch.update({"flat_group_frac": 0.0, "truncation_rate": 0.6}, 3)[0].startswith("truncation_rate")


class OneProcess:
    rank, world_size, device = 0, 1, torch.device("cpu")
    dp_rank, dp_size, tp_rank, tp_size = 0, 1, 0, 1

    def all_reduce_sum(self, tensor):
        return tensor


def test_evaluate_scores_greedily_in_prompt_order_with_intervals():
    texts = {0: "y.", 1: "n.", 2: "y", 3: "yy."}
    engine = ScriptedEngine({(p, call): [texts[p]] for p in texts for call in range(3)})
    prompt_ids = [[0], [1, 1, 1], [2, 2], [3]]
    result = evaluate(engine, SCORER, ROWS, prompt_ids, OneProcess(), max_new_tokens=4, batch_size=2)
    # Batches hold prompts of similar length (longest first), and results come back in prompt order.
    assert [r["prompts"] for r in engine.requests] == [[[1, 1, 1], [2, 2]], [[0], [3]]]
    assert all(r["temperature"] == 0.0 for r in engine.requests)
    assert result["values"]["reward"] == [1.0, 0.0, 1.0, 1.0] and result["values"]["format"] == [1.0, 1.0, 0.0, 1.0]
    assert result["values"]["answer"] == [1.0, 0.0, 1.0, 1.0] and result["count"] == 4
    mean, low, high = result["means"]["reward"]
    assert mean == 0.75 and low == pytest.approx(0.75 - 3.182446305284263 * 0.25, abs=1e-9)
    flat = summarize(result)
    assert flat["eval/reward"] == 0.75 and flat["eval/count"] == 4.0 and flat["eval/acc_high"] == high
    assert [c.text for c in greedy_completions(engine, prompt_ids, max_new_tokens=4, batch_size=4)] == \
        ["y.", "n.", "y", "yy."]
    from grpo.config import TrainerConfig
    assert [d for d in range(8) if held_out_due(d, 0, TrainerConfig(steps=7, eval_every=3))] == [0, 3, 6, 7]
    assert [d for d in range(8) if held_out_due(d, 0, TrainerConfig(steps=7, eval_every=0))] == [0, 7]


def test_statistics_on_fixed_numbers():
    # 32 zeros and 32 ones: mean 0.5, s = sqrt(64 * 0.25 / 63) = 0.5039526, s / sqrt(64) = 0.06299408;
    # t_{0.975, 63} = 1.998340522 (tables) -> half width 0.1258836.
    mean, low, high = mean_interval([0.0] * 32 + [1.0] * 32)
    assert mean == 0.5 and low == pytest.approx(0.3741164, abs=1e-7) and high == pytest.approx(0.6258836, abs=1e-7)
    # 5 zeros and 5 ones: s / sqrt(10) = sqrt(10 * 0.25 / 9) / sqrt(10) = 1/6; t_{0.975, 9} = 2.262157163 (tables).
    assert mean_interval([0.0] * 5 + [1.0] * 5) == pytest.approx((0.5, 0.5 - 2.262157163 / 6, 0.5 + 2.262157163 / 6),
                                                                 abs=1e-9)
    # Paired: after - before = [0.1, 0.3] -> mean 0.2, s = 0.1414214, se = 0.1, t_{0.975, 1} = 12.7062047.
    assert paired_difference([0.5, 0.2], [0.6, 0.5]) == pytest.approx((0.2, 0.2 - 1.270620474, 0.2 + 1.270620474))
    assert math.isnan(mean_interval([1.0])[1]) and mean_interval([math.nan, 1.0, 1.0])[0] == 1.0
    with pytest.raises(ValueError, match="same prompts on both sides: 2 vs 1"):
        paired_difference([0.1, 0.2], [0.3])
