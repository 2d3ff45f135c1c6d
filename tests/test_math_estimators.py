"""The advantage estimators behind compute_advantages: hand-derived reference numbers for RLOO and REINFORCE++,
then properties (flat groups give exactly 0, RLOO = G/(G-1) Dr. GRPO, 2 ranks = 1 process, fillers left out),
equality with the functions the loop called before the registry, and the refusal of token returns."""
import math

import pytest
import torch

from grpo.advantages import (ESTIMATORS, batch_moments, completion_returns, compute_advantages, group_advantages,
                             moments_std, register_estimator)

F64 = dict(dtype=torch.float64)


def identity(tensor):
    return tensor


def _mask(lengths, tokens, dtype=torch.float32):
    return (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)


def _batch(seed: int, prompts: int = 4, group_size: int = 4, tokens: int = 6, dtype=torch.float32):
    """Rewards [B], sentence-like token shaping [B, T] and a right-padded mask [B, T] of at least one token."""
    gen = torch.Generator().manual_seed(seed)
    size = prompts * group_size
    rewards = torch.rand(size, generator=gen, dtype=torch.float64).to(dtype)
    shaping = (0.1 * torch.randn(size, tokens, generator=gen, dtype=torch.float64)).to(dtype)
    mask = _mask(torch.randint(1, tokens + 1, (size,), generator=gen).tolist(), tokens, dtype)
    return rewards, shaping * mask, mask


def test_registry_names_and_kinds():
    assert tuple(ESTIMATORS) == ("grpo", "dr_grpo", "batch_std", "rloo", "reinforce_pp", "none")
    assert [name for name in tuple(ESTIMATORS) if ESTIMATORS[name].token_returns] == ["grpo", "dr_grpo", "batch_std"]
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_estimator("grpo", token_returns=True)(lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid: grpo, dr_grpo, batch_std, rloo"):
        compute_advantages("ppo", torch.ones(2), torch.zeros(2, 1), torch.ones(2, 1), 2)


def test_a_new_estimator_is_one_function():
    # Registering is all it takes for compute_advantages to dispatch to it, with every argument by keyword.
    @register_estimator("test_constant", token_returns=False)
    def constant(rewards, token_shaping, mask, group_size, *, eps, weights, all_reduce_sum):
        return torch.full_like(token_shaping, eps) * mask

    try:
        out = compute_advantages("test_constant", torch.ones(2), torch.zeros(2, 2), torch.tensor([[1.0, 0], [1, 1]]), 2,
                                 eps=0.5)
        torch.testing.assert_close(out, torch.tensor([[0.5, 0], [0.5, 0.5]]), rtol=0, atol=0)
    finally:
        del ESTIMATORS["test_constant"]


def test_rloo_reference_numbers():
    # Leave-one-out baselines, A_i = r_i - (sum_g - r_i) / (G - 1):
    # group [1, 0, 1, 1] (sum 3): baselines 2/3, 1, 2/3, 2/3 -> A = 1/3, -1, 1/3, 1/3;
    # group [.7, .7, .7, .7]: flat -> exactly 0;
    # group [.5, 0, 1, .2] (sum 1.7): baselines 1.2/3, 1.7/3, .7/3, 1.5/3 -> A = .1, -1.7/3, 2.3/3, -.3.
    # Broadcast over the mask (lengths 3, 1, 2, 3 | 3, 3, 3, 3 | 2, 3, 1, 3), 0 on padding.
    rewards = torch.tensor([1, 0, 1, 1, 0.7, 0.7, 0.7, 0.7, 0.5, 0, 1, 0.2], **F64)
    mask = _mask([3, 1, 2, 3, 3, 3, 3, 3, 2, 3, 1, 3], 3, torch.float64)
    out = compute_advantages("rloo", rewards, torch.zeros(12, 3, **F64), mask, 4)
    per_completion = torch.tensor([1 / 3, -1, 1 / 3, 1 / 3, 0, 0, 0, 0, 0.1, -1.7 / 3, 2.3 / 3, -0.3], **F64)
    torch.testing.assert_close(out, per_completion[:, None] * mask, rtol=0, atol=1e-15)
    assert (out[4:8] == 0).all()


def test_reinforce_pp_reference_numbers():
    # Outcome reward on the last real token, gamma = 1: the return is R_i on each of completion i's real tokens.
    # Rewards [1, 0 | 0, 1], lengths [3, 1, 2, 2]: the batch's 8 real tokens hold five 1s and three 0s.
    # mean 5/8; Bessel variance (5 - 8 (5/8)^2) / 7 = (5 - 25/8) / 7 = 15/56;
    # A = (R - 5/8) / sqrt(15/56 + 1e-8): 3/8 / .51754919.. = .72456.. on R = 1, -5/8 / .51754919.. on R = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], **F64)
    mask = _mask([3, 1, 2, 2], 3, torch.float64)
    out = compute_advantages("reinforce_pp", rewards, torch.zeros(4, 3, **F64), mask, 2)
    scale = 1 / math.sqrt(15 / 56 + 1e-8)
    expected = torch.tensor([[3 / 8] * 3, [-5 / 8, 0, 0], [-5 / 8, -5 / 8, 0], [3 / 8, 3 / 8, 0]], **F64) * scale
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    # Over the real tokens the advantages have mean 0 and (Bessel) variance var / (var + 1e-8).
    real = out[mask > 0]
    assert abs(real.mean().item()) < 1e-15
    assert real.var().item() == pytest.approx((15 / 56) / (15 / 56 + 1e-8), abs=1e-14)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "batch_std", "rloo"])
def test_flat_groups_give_exactly_zero(estimator):
    # float32 alone gives 0.056 for eight 0.7s under GRPO's std; every group estimator zeroes flat groups.
    rewards, _, mask = _batch(seed=3, prompts=3, group_size=8)
    rewards[8:16] = 0.7
    shaping = torch.zeros_like(mask)
    out = compute_advantages(estimator, rewards, shaping, mask, 8)
    assert (out[8:16] == 0).all() and (out[:8] != 0).any()


def test_reinforce_pp_flat_batch_gives_exactly_zero():
    # REINFORCE++'s baseline is the batch's: a flat group is not zeroed, but a flat batch is, exactly: the float64
    # sum of float32 rewards is exact, so the mean is 0.7f itself.
    rewards, _, mask = _batch(seed=4)
    out = compute_advantages("reinforce_pp", torch.full_like(rewards, 0.7), torch.zeros_like(mask), mask, 4)
    assert (out == 0).all()


def test_rloo_is_g_over_g_minus_1_times_dr_grpo():
    for group_size in (2, 3, 8):
        rewards, _, mask = _batch(seed=group_size, prompts=3, group_size=group_size)
        zero = torch.zeros_like(mask)
        rloo = compute_advantages("rloo", rewards, zero, mask, group_size)
        dr_grpo = compute_advantages("dr_grpo", rewards, zero, mask, group_size)
        torch.testing.assert_close(rloo, dr_grpo * (group_size / (group_size - 1)), rtol=0, atol=0)


def test_token_return_estimators_equal_the_calls_they_replace():
    # Bit for bit what the loop computed before the registry (sentence shaping, a filler group of weight 0).
    rewards, shaping, mask = _batch(seed=5)
    weights = torch.ones(16)
    weights[12:] = 0
    mask[12:] = 0
    for estimator, scale in (("grpo", "group"), ("dr_grpo", "none")):
        out = compute_advantages(estimator, rewards, shaping, mask, 4, eps=1e-6, weights=weights)
        assert torch.equal(out, group_advantages(rewards, 4, token_shaping=shaping, mask=mask, scale=scale, eps=1e-6))
    batch_std = moments_std(batch_moments(completion_returns(rewards, shaping, mask), weights))
    before = group_advantages(rewards, 4, token_shaping=shaping, mask=mask, scale="batch", eps=1e-6,
                              batch_std=batch_std)
    out = compute_advantages("batch_std", rewards, shaping, mask, 4, eps=1e-6, weights=weights)
    assert torch.equal(out, before)


def _two_ranks(estimator, rewards, shaping, mask, group_size, split, weights=None):
    """Run `estimator` as two ranks holding rows [:split] and [split:], with an all_reduce_sum that adds the other
    rank's tensor (recorded in a first pass): what a sum over two processes gives each of them."""
    halves = [slice(0, split), slice(split, None)]
    sent = []

    def record(tensor):
        sent.append(tensor.clone())
        return tensor

    def run(rank, reduce):
        part = halves[rank]
        return compute_advantages(estimator, rewards[part], shaping[part], mask[part], group_size,
                                  weights=None if weights is None else weights[part], all_reduce_sum=reduce)

    for rank in (0, 1):
        run(rank, record)
    assert len(sent) == 2  # one collective per rank
    return torch.cat([run(rank, lambda t, other=sent[1 - rank]: t + other) for rank in (0, 1)])


@pytest.mark.parametrize("estimator", ["reinforce_pp", "batch_std"])
def test_two_ranks_equal_one_process(estimator):
    rewards, shaping, mask = _batch(seed=6, prompts=6, dtype=torch.float64)
    if estimator == "reinforce_pp":
        shaping = torch.zeros_like(shaping)
    whole = compute_advantages(estimator, rewards, shaping, mask, 4)
    # Random float64 values: the sums run in another order, so the last bits may differ.
    torch.testing.assert_close(_two_ranks(estimator, rewards, shaping, mask, 4, split=8), whole, rtol=0, atol=1e-14)
    # Dyadic rewards (multiples of 1/8, no shaping): every float64 sum is exact, so the two agree bit for bit.
    dyadic = torch.randint(-8, 9, rewards.shape, generator=torch.Generator().manual_seed(7)).to(torch.float64) / 8
    zero = torch.zeros_like(shaping)
    assert torch.equal(_two_ranks(estimator, dyadic, zero, mask, 4, split=16),
                       compute_advantages(estimator, dyadic, zero, mask, 4))


@pytest.mark.parametrize("estimator", tuple(ESTIMATORS))
def test_collectives_are_called_once_by_batch_estimators_only(estimator):
    rewards, _, mask = _batch(seed=8)
    calls = []
    compute_advantages(estimator, rewards, torch.zeros_like(mask), mask, 4,
                       all_reduce_sum=lambda t: calls.append(t.dtype) or t)
    assert calls == ([torch.float64] if estimator in ("batch_std", "reinforce_pp") else [])


@pytest.mark.parametrize("estimator", ["reinforce_pp", "batch_std"])
def test_filler_groups_set_no_batch_statistic(estimator):
    # A filler group (weight 0) with an outlying reward leaves the real rows' advantages exactly as without it,
    # whether its mask is 0 (as the loop makes it) or not: the weights alone exclude it. Dyadic rewards again.
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.75], **F64)
    mask = _mask([3, 1, 2, 2, 3, 1], 3, torch.float64)
    zero = torch.zeros_like(mask)
    alone = compute_advantages(estimator, rewards, zero, mask, 2)
    padded_rewards = torch.cat([rewards, torch.tensor([100.0, -50.0], **F64)])
    weights = torch.tensor([1.0] * 6 + [0.0] * 2, **F64)
    for filler_mask in (torch.zeros(2, 3, **F64), torch.ones(2, 3, **F64)):
        padded_mask = torch.cat([mask, filler_mask])
        out = compute_advantages(estimator, padded_rewards, torch.zeros_like(padded_mask), padded_mask, 2,
                                 weights=weights)
        assert torch.equal(out[:6], alone)


def test_outcome_estimators_refuse_token_returns():
    rewards, shaping, mask = _batch(seed=9)
    message = (r"algorithm.adv_estimator=rloo is defined for outcome rewards only, but the reward returned sentence "
               r"rewards \(token_shaping is not zero\); set reward.sentence_coef=0 or use grpo, dr_grpo or batch_std")
    with pytest.raises(ValueError, match=message):
        compute_advantages("rloo", rewards, shaping, mask, 4)
    with pytest.raises(ValueError, match="adv_estimator=reinforce_pp is defined for outcome rewards only"):
        compute_advantages("reinforce_pp", rewards, shaping, mask, 4)
    for estimator in ("grpo", "dr_grpo", "batch_std"):
        assert torch.isfinite(compute_advantages(estimator, rewards, shaping, mask, 4)).all()


@pytest.mark.parametrize("estimator", tuple(ESTIMATORS))
def test_every_estimator_is_zero_on_padding_and_checks_its_input(estimator):
    rewards, _, mask = _batch(seed=10)
    out = compute_advantages(estimator, rewards, torch.zeros_like(mask), mask, 4)
    assert out.shape == mask.shape and out.dtype == rewards.dtype and (out[mask == 0] == 0).all()
    with pytest.raises(ValueError, match="not divisible by group_size 3"):
        compute_advantages(estimator, rewards, torch.zeros_like(mask), mask, 3)
    with pytest.raises(ValueError, match=r"token_shaping has shape \(16, 5\) but mask has shape \(16, 6\)"):
        compute_advantages(estimator, rewards, torch.zeros(16, 5), mask, 4)
    with pytest.raises(ValueError, match=r"weights has shape \(15,\) but rewards has shape \(16,\)"):
        compute_advantages(estimator, rewards, torch.zeros_like(mask), mask, 4, weights=torch.ones(15))
