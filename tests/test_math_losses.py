"""Policy loss (token level and GSPO's sequence level), aggregations, KL estimators, truncated IS, overlong
shaping, the KL penalty in the reward and the DAPO group filter."""
import math

import pytest
import torch

from grpo.advantages import group_advantages, keep_groups, kl_reward_penalty, overlong_penalty
from grpo.config import AGGREGATIONS, AlgorithmConfig, ConfigError
from grpo.losses import (AGGREGATION, aggregate, kl_penalty, loss_denominator, policy_loss, sequence_log_ratio,
                         truncated_is_weights)

F64 = dict(dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], **F64)
OLD = torch.tensor([[-1, -0.5, -2, 0, 0], [-1.2, -0.7, -3, -0.4, -2.5]], **F64)
NEW = torch.tensor([[-0.9, -0.3, -1.6, 0, 0], [-1.5, -0.8, -3, -0.1, -1.1]], **F64)
ADV = torch.tensor([1.0, -0.5], **F64)


def test_policy_loss_reference_numbers():
    # Sequence 1 (A=+1): ratios e^.1, e^.2, e^.4 = 1.10517, 1.22140, 1.49182; clip 0.2/0.28 caps the last at
    # 1.28, so token losses max(-r, -clip(r)) = -1.10517, -1.22140, -1.28 (sum -3.606572).
    # Sequence 2 (A=-.5): ratios e^-.3, e^-.1, 1, e^.3, e^1.4 = .740818, .904837, 1, 1.349859, 4.055200;
    # max(.5r, .5 clip(r)) = .4, .452419, .5, .674929, 2.027600; dual clip 3 caps at .5*3 = 1.5 (sum 3.527348).
    # token-mean: (-3.606572 + 3.527348)/8 ; seq-mean-token-mean: (-3.606572/3 + 3.527348/5)/2.
    kwargs = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, metrics = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(agg="token-mean", **kwargs))
    assert loss.item() == pytest.approx(-0.0099031954, abs=1e-10)
    loss, _ = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(agg="seq-mean-token-mean", **kwargs))
    # The quoted reference value is -0.2483608001; the derivation above gives -0.24836080142 (the quoted 10-digit figure
    # is off by 1.3e-9), so pin our own derivation tightly and the quoted figure to 2e-9.
    assert loss.item() == pytest.approx(-0.24836080142, abs=1e-11)
    assert loss.item() == pytest.approx(-0.2483608001, abs=2e-9)
    # Symmetric clip 0.2: sequence 1 becomes -1.10517, -1.2, -1.2 (sum -3.505171).
    loss, _ = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(clip_low=0.2, clip_high=0.2, dual_clip=3.0))
    assert loss.item() == pytest.approx(0.0027721493, abs=1e-10)
    loss, _ = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(clip_low=0.2, clip_high=0.2, dual_clip=3.0,
                                                     agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(-0.23146034173, abs=1e-11)  # quoted: -0.2314603405 (same rounding)
    assert loss.item() == pytest.approx(-0.2314603405, abs=2e-9)
    # Clip fractions over the 8 masked tokens: upper = seq 1 token 3 (1.49 > 1.28) -> 1/8; lower = seq 2
    # token 1 (.74 < .8) -> 1/8; dual = seq 2 token 5 -> 1/8.
    assert metrics["clip_frac_upper"].item() == pytest.approx(1 / 8)
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 8)
    assert metrics["clip_frac_dual"].item() == pytest.approx(1 / 8)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(1.4))


def test_policy_loss_float32_matches_float64():
    loss32, _ = policy_loss(NEW.float(), OLD.float(), ADV.float(), MASK.float(),
                            AlgorithmConfig(clip_high=0.28, dual_clip=3.0))
    assert loss32.item() == pytest.approx(-0.0099031954, rel=1e-5)


def test_sum_norm_reference():
    # Dr. GRPO at ratio 1 (new == old): token losses are -A: seq 1 sums 3 * -1 = -3, seq 2 sums 5 * .5 = 2.5;
    # (-3 + 2.5) / (2 sequences * max_len 10) = -0.025.
    loss, _ = policy_loss(OLD, OLD, ADV, MASK, AlgorithmConfig(agg="seq-mean-token-sum-norm"), max_len=10)
    assert loss.item() == pytest.approx(-0.025, abs=1e-15)
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(OLD, OLD, ADV, MASK, AlgorithmConfig(agg="seq-mean-token-sum-norm"))


def test_on_policy_gradient_is_reinforce():
    # At ratio 1 nothing is clipped and d loss / d logprob = -A / num_tokens on masked tokens.
    logprobs = OLD.clone().requires_grad_(True)
    advantages = torch.tensor([[0.3, -1, 2, 0.5, 0.1], [1, 1, -2, 0.7, -0.4]], **F64)
    loss, _ = policy_loss(logprobs, OLD, advantages, MASK)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -advantages * MASK / 8, rtol=0, atol=1e-15)


def test_clipped_tokens_get_zero_gradient():
    logprobs = NEW.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, OLD, ADV, MASK, AlgorithmConfig(clip_high=0.28, dual_clip=3.0))
    loss.backward()
    grad = logprobs.grad
    # Clipped: seq 1 token 3 (upper), seq 2 token 1 (lower), seq 2 token 5 (dual); padding too.
    for b, t in [(0, 2), (1, 0), (1, 4), (0, 3), (0, 4)]:
        assert grad[b, t].item() == 0.0
    # An unclipped token: d/dlogp (-A * e^(logp-old)) / 8 = -A * ratio / 8.
    assert grad[0, 0].item() == pytest.approx(-1.0 * math.exp(0.1) / 8, abs=1e-12)


def _random_batch(seed: int, step: float):
    """6 sequences x 7 tokens: old logprobs, new = old + step * noise, per-sequence advantages, a mask whose
    first token is always kept (float64)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=gen, **F64) * 3
    new = old + step * torch.randn(6, 7, generator=gen, **F64)
    advantages = torch.randn(6, generator=gen, **F64)
    mask = (torch.rand(6, 7, generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    return old, new, advantages, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_denominator_equal_full_batch(agg):
    old, new, advantages, mask = _random_batch(seed=0, step=0.3)
    spec = AlgorithmConfig(clip_high=0.28, dual_clip=3.0, agg=agg)
    max_len = 7 if agg == "seq-mean-token-sum-norm" else None
    full = new.clone().requires_grad_(True)
    policy_loss(full, old, advantages, mask, spec, max_len=max_len)[0].backward()
    micro = new.clone().requires_grad_(True)
    denominator = loss_denominator(mask, agg)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        policy_loss(micro[rows], old[rows], advantages[rows], mask[rows], spec, denominator=denominator,
                    max_len=max_len)[0].backward()
    torch.testing.assert_close(micro.grad, full.grad, rtol=0, atol=1e-15)


def test_all_padding_sequence_contributes_zero_and_no_nan():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], **F64)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, metrics = policy_loss(OLD[:, :3], OLD[:, :3], ADV, mask,
                                    AlgorithmConfig(agg=agg), max_len=3 if agg == "seq-mean-token-sum-norm" else None)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    # Only sequence 1 counts: token-mean = 2 * -1 / 2 = -1.
    assert policy_loss(OLD[:, :3], OLD[:, :3], ADV, mask)[0].item() == -1.0
    assert policy_loss(OLD[:1, :3], OLD[:1, :3], ADV[:1], torch.zeros(1, 3, **F64))[0].item() == 0.0


def test_is_weights_multiply_token_loss():
    weights = torch.full_like(MASK, 0.5)
    plain, _ = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(clip_high=0.28, dual_clip=3.0))
    weighted, _ = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(clip_high=0.28, dual_clip=3.0), is_weights=weights)
    assert weighted.item() == pytest.approx(0.5 * plain.item(), abs=1e-15)


def test_policy_loss_bad_input():
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 4\) but logprobs has shape \(2, 5\)"):
        policy_loss(NEW, OLD[:, :4], ADV, MASK)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        policy_loss(NEW, OLD, torch.ones(3, **F64), MASK)
    with pytest.raises(ConfigError, match="is not one of token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(agg="mean"))
    with pytest.raises(ConfigError, match=r"algorithm\.dual_clip=0\.5 is out of range: it must be > 1"):
        policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(dual_clip=0.5))
    with pytest.raises(ValueError, match=r"logprobs must have 2 dimension\(s\), got shape \(5,\)"):
        policy_loss(NEW[0], OLD[0], ADV, MASK[0])


def test_gspo_reference_numbers():
    # Sequence log-ratios (masked means): seq 1 (.1 + .2 + .4) / 3 = .2333333, s1 = e^.2333333 = 1.2628023;
    # seq 2 (-.3 - .1 + 0 + .3 + 1.4) / 5 = .26, s2 = e^.26 = 1.2969301. Every token of a sequence carries its s.
    # GSPO's clip 3e-4 / 4e-4: seq 1 (A = +1) max(-s1, -1.0004) = -1.0004, clipped; seq 2 (A = -.5)
    # max(.5 s2, .5 * 1.0004) = .6484650, not clipped (A < 0 and s > 1 + eps is the pessimistic side).
    # seq-mean-token-mean: (-1.0004 + .6484650) / 2 = -.1759675; token-mean: (3 * -1.0004 + 5 * .6484650) / 8.
    logprobs = NEW.clone().requires_grad_(True)
    kwargs = dict(clip_low=3e-4, clip_high=4e-4, ratio_level="sequence")
    loss, metrics = policy_loss(logprobs, OLD, ADV, MASK, AlgorithmConfig(agg="seq-mean-token-mean", **kwargs))
    assert loss.item() == pytest.approx(-0.17596747833355703, abs=1e-12)
    token_mean = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(**kwargs))[0]
    assert token_mean.item() == pytest.approx(0.03014065208305372, abs=1e-12)
    assert metrics["clip_frac_upper"].item() == 3 / 8 and metrics["clip_frac_lower"].item() == 0.0
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.26), abs=1e-12)
    # Gradient: seq 1 is clipped (0 everywhere); seq 2's tokens get d(.5 s2)/d logp_t / 2 sequences with
    # d s2 / d logp_t = s2 / 5: .5 * 1.2969301 / 5 / 2 = .0648465 on each of its 5 tokens.
    loss.backward()
    assert (logprobs.grad[0] == 0).all()
    torch.testing.assert_close(logprobs.grad[1], torch.full((5,), 0.5 * math.exp(0.26) / 10, **F64), rtol=0,
                               atol=1e-15)
    # A token-level clip range with a sequence ratio: 0.2 / 0.28 clips neither sequence here; seq 1 now gets
    # -s1 / 3 / 2 = -.2104671 per token, and the loss is (-1.2628023 + .6484650) / 2 = -.3071686.
    logprobs = NEW.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, OLD, ADV, MASK, AlgorithmConfig(clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean",
                                                           ratio_level="sequence"))
    loss.backward()
    assert loss.item() == pytest.approx(-0.30716864998045773, abs=1e-12)
    torch.testing.assert_close(logprobs.grad[0, :3], torch.full((3,), -math.exp(0.7 / 3) / 6, **F64), rtol=0,
                               atol=1e-15)
    assert (logprobs.grad[0, 3:] == 0).all()


def test_gspo_token_form_equals_the_sequence_objective():
    # With one advantage per sequence and seq-mean-token-mean, GSPO-token's loss and gradient are GSPO's own:
    # mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t (logp - old)), differentiated through s_i.
    old, new, advantages, mask = _random_batch(seed=1, step=0.05)
    token_form = new.clone().requires_grad_(True)
    loss, _ = policy_loss(token_form, old, advantages, mask, AlgorithmConfig(clip_low=0.01, clip_high=0.012,
                          agg="seq-mean-token-mean", ratio_level="sequence"))
    loss.backward()
    direct = new.clone().requires_grad_(True)
    s = torch.exp(((direct - old) * mask).sum(1) / mask.sum(1))
    expected = torch.maximum(-advantages * s, -advantages * s.clamp(1 - 0.01, 1 + 0.012)).mean()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-14)
    torch.testing.assert_close(token_form.grad, direct.grad, rtol=0, atol=1e-15)
    # Value: the sequence's mean log-ratio on every masked token of it.
    log_ratio = sequence_log_ratio(new, old, mask)
    torch.testing.assert_close(log_ratio[:, :1], (((new - old) * mask).sum(1) / mask.sum(1))[:, None])
    # One-token sequences: the sequence ratio is the token ratio.
    one = torch.ones(6, 1, **F64)
    sequence = policy_loss(new[:, :1], old[:, :1], advantages, one, AlgorithmConfig(ratio_level="sequence"))[0]
    torch.testing.assert_close(sequence, policy_loss(new[:, :1], old[:, :1], advantages, one)[0], rtol=0, atol=1e-15)
    with pytest.raises(ConfigError, match="algorithm.ratio_level: 'seq' is not one of token, sequence"):
        policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(ratio_level="seq"))


def test_kl_in_reward_reference_numbers():
    # verl's use_kl_in_reward with a fixed coefficient: token rewards lose beta * kl_t, and GRPO's outcome
    # advantage sums them. old - ref = [.5, -1 | .2 (padding ignored: mask 0)], beta = .1.
    # k1: sums .5 - 1 = -.5 and 0 -> penalties +.05 and 0.
    # k3: exp(-.5) + .5 - 1 = .1065307, exp(1) - 1 - 1 = .7182818 -> -.1 * .82481248817 = -.0824812488;
    # row 2: 0.
    old = torch.tensor([[-1.0, -2.0], [-0.3, -0.5]], **F64)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -0.5]], **F64)
    mask = torch.tensor([[1, 1], [0, 0]], **F64)
    k1 = kl_reward_penalty(kl_penalty(old, ref, "k1"), mask, 0.1)
    torch.testing.assert_close(k1, torch.tensor([0.05, 0.0], **F64), rtol=0, atol=1e-15)
    k3 = kl_reward_penalty(kl_penalty(old, ref, "k3"), mask, 0.1)
    torch.testing.assert_close(k3, torch.tensor([-0.0824812488172, 0.0], **F64), rtol=0, atol=1e-11)
    # Then the group advantage of rewards [1, 1] is no longer flat: [1 - .0824812, 1] -> A = [-.7071, .7071]
    # (two values: (r - mean) / (std + eps) with std = |diff| / sqrt(2)).
    advantages = group_advantages(torch.tensor([1.0, 1.0], **F64) + k3, 2)
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0], **F64) / math.sqrt(2), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="coef must be >= 0"):
        kl_reward_penalty(kl_penalty(old, ref), mask, -0.1)


def test_kl_reference_numbers():
    # d = logp - ref = [.5, -1]: k1 = d; abs = |d|; k2 = d^2/2 = [.125, .5];
    # k3 = e^-d + d - 1 = [e^-.5 - .5, e^1 - 2] = [.1065307, .7182818].
    logprobs = torch.tensor([[-1.0, -2.0]], **F64)
    ref = torch.tensor([[-1.5, -1.0]], **F64)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([[0.5, -1.0]], **F64))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "abs"), torch.tensor([[0.5, 1.0]], **F64))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([[0.125, 0.5]], **F64))
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2]], **F64)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), k3, rtol=0, atol=1e-15)
    # Clamps: d = -50 is clamped to -20 (k1 = -20) and k3 = e^20 - 21 is clamped to 10.
    far = kl_penalty(torch.tensor([[-60.0]]), torch.tensor([[-10.0]]), "k3")
    assert far.item() == 10.0 and kl_penalty(torch.tensor([[-60.0]]), torch.tensor([[-10.0]]), "k1").item() == -20.0
    with pytest.raises(ValueError, match="valid: k1, abs, k2, k3"):
        kl_penalty(logprobs, ref, "k4")


def test_truncated_is_weights():
    old = torch.tensor([[-1.0, -2.0, -0.5]], **F64)
    rollout = torch.tensor([[-1.1, -1.0, -2.0]], **F64)
    # token: e^.1, e^-1, e^1.5 -> capped at 2: [1.1051709, .3678794, 2].
    expected = torch.tensor([[math.exp(0.1), math.exp(-1), 2.0]], **F64)
    torch.testing.assert_close(truncated_is_weights(old, rollout, cap=2.0), expected, rtol=0, atol=1e-15)
    # sequence over the first two tokens: e^(.1 - 1) = .4065697 on every token.
    mask = torch.tensor([[1, 1, 0]], **F64)
    seq = truncated_is_weights(old, rollout, cap=2.0, level="sequence", mask=mask)
    torch.testing.assert_close(seq, torch.full((1, 3), math.exp(-0.9), **F64), rtol=0, atol=1e-15)
    assert not truncated_is_weights(old.requires_grad_(True), rollout).requires_grad
    with pytest.raises(ValueError, match="needs mask"):
        truncated_is_weights(old, rollout, level="sequence")


def test_aggregate_matches_loop():
    values = torch.tensor([[1.0, 2, 3], [4, 5, 6]], **F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], **F64)
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(7 / 8)


def test_aggregation_table_is_what_loss_denominator_and_aggregate_use():
    # One entry per mode: loss_denominator is its count, aggregate its numerator over that count (times max_len
    # for Dr. GRPO), with a given denominator in place of the local count.
    values = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]], **F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], **F64)
    assert AGGREGATIONS == tuple(AGGREGATION)
    assert [loss_denominator(mask, agg).item() for agg in AGGREGATIONS] == [3.0, 2.0, 2.0]
    for agg in AGGREGATIONS:
        entry = AGGREGATION[agg]
        scale = 4 if entry.per_max_len else 1
        expected = entry.numerator(values * mask, mask) / (entry.count(mask) * scale)
        assert aggregate(values, mask, agg, max_len=4).item() == expected.item()
        assert aggregate(values, mask, agg, denominator=10.0, max_len=4).item() == pytest.approx(
            entry.numerator(values * mask, mask).item() / (10 * scale), abs=1e-15)
    with pytest.raises(ValueError, match="needs max_len >= 1"):
        aggregate(values, mask, "seq-mean-token-sum-norm")


def test_sft_loss_through_the_table_is_the_hand_rolled_token_mean():
    # grpo/sft.py's loss: -(logprobs * mask).sum() / num_tokens over the step, now aggregate(-logprobs, ...,
    # "token-mean", denominator=num_tokens); bit for bit, in float32 as the SFT loop runs, and its gradient too.
    gen = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(4, 9, generator=gen) * 5
    mask = (torch.rand(4, 9, generator=gen) > 0.4).long()
    num_tokens = torch.as_tensor(loss_denominator(mask, "token-mean") + 7, dtype=torch.float32)  # + other ranks
    hand, table = logprobs.clone().requires_grad_(True), logprobs.clone().requires_grad_(True)
    expected = -(hand * mask.to(hand.dtype)).sum() / num_tokens.clamp(min=1)
    loss = aggregate(-table, mask, "token-mean", denominator=num_tokens)
    expected.backward()
    loss.backward()
    assert torch.equal(loss, expected) and torch.equal(table.grad, hand.grad)
    assert loss_denominator(mask, "token-mean").item() == mask.sum().item()


def test_overlong_penalty_reference():
    # max_len 20, cache 4: free up to 16, then -(len-16)/4 * factor; -factor from 20 on.
    lengths = torch.tensor([0, 16, 17, 19, 20, 100])
    out = overlong_penalty(lengths, max_len=20, cache_len=4, factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0, 0, -0.125, -0.375, -0.5, -0.5]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="cache_len=30, max_len=20"):
        overlong_penalty(lengths, max_len=20, cache_len=30)


def test_keep_groups():
    metric = torch.tensor([1.0, 0, 1, 0, 0, 0, 0.5, 0.5, 0.5])
    assert keep_groups(metric, 3).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="not divisible by group_size 4"):
        keep_groups(metric, 4)
