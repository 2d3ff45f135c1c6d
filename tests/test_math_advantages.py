"""Group advantages and token-shaped advantages: hand-derived reference numbers, then properties."""
import math

import pytest
import torch

from grpo.advantages import batch_moments, completion_returns, group_advantages, moments_std

REWARDS = [1, 0, 1, 1, 1, 1, 1, 1, 0.5, 0, 1, 0.2]


def test_group_reference_numbers():
    # Group 1 [1,0,1,1]: mean 0.75, centred [.25,-.75,.25,.25], sum of squares .75, Bessel var .75/3 = .25,
    # std .5 -> .25/(.5+1e-6) = 0.499999.  Group 2 is flat -> exactly 0.
    # Group 3 [.5,0,1,.2]: mean .425, centred [.075,-.425,.575,-.225], sum of squares .5675,
    # var .5675/3 = .189166.., std .434932.. -> .075/.434933 = .1724399782 etc.
    expected = [0.499999, -1.499997, 0.499999, 0.499999, 0, 0, 0, 0,
                0.1724399782, -0.9771598765, 1.3220398329, -0.5173199346]
    out64 = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4)
    torch.testing.assert_close(out64, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    out32 = group_advantages(torch.tensor(REWARDS), 4)
    torch.testing.assert_close(out32, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert (out32[4:8] == 0).all()


def test_none_reference_numbers():
    # Dr. GRPO: the centred rewards of each group, no division.
    expected = [0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0, 0.075, -0.425, 0.575, -0.225]
    out = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, scale="none")
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_batch_scale_reference():
    # rewards [1,0 | 1,1]: group means .5 and 1; batch std of [1,0,1,1] = sqrt(.75/3) = .5.
    # group 1 -> [.5, -.5] / .500001 ; group 2 flat -> 0.
    out = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), 2, scale="batch")
    expected = torch.tensor([0.5 / 0.500001, -0.5 / 0.500001, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_batch_std_summed_over_ranks_is_the_whole_batch_std():
    # Two "ranks" each hold 2 groups of 3; moments (count, sum, sum of squares) add up, so the std from the
    # summed moments is torch's Bessel std of all 12 rewards, and each rank's advantages equal the slices of
    # the advantages of the whole batch.
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    summed = batch_moments(rewards[:6]) + batch_moments(rewards[6:])
    assert moments_std(summed).item() == pytest.approx(rewards.std().item(), abs=1e-14)
    whole = group_advantages(rewards, 3, scale="batch")
    parts = [group_advantages(rewards[s], 3, scale="batch", batch_std=moments_std(summed)) for s in (slice(0, 6),
                                                                                                    slice(6, 12))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-14)
    # Reference: [1, 0 | 1, 1] on rank 0 and [0, 0 | 1, 0] on rank 1: n = 8, sum 4, sum of squares 4;
    # var = (4 - 16/8) / 7 = 2/7, std = .5345225; rank 0's first group [.5, -.5] / (.5345225 + 1e-6).
    moments = batch_moments(torch.tensor([1.0, 0, 1, 1])) + batch_moments(torch.tensor([0.0, 0, 1, 0]))
    assert moments.tolist() == [8.0, 4.0, 4.0] and moments.dtype == torch.float64
    std = moments_std(moments)
    assert std.item() == pytest.approx(math.sqrt(2 / 7), abs=1e-15)
    out = group_advantages(torch.tensor([1.0, 0, 1, 1], dtype=torch.float64), 2, scale="batch", batch_std=std)
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0, 0], dtype=torch.float64) / (math.sqrt(2 / 7) + 1e-6),
                               rtol=0, atol=1e-15)


def test_batch_moments_leave_out_zero_weight_rows_and_feed_shaped_advantages():
    # Filler groups of dynamic sampling (loss weight 0) do not set the batch scale.
    values = torch.tensor([1.0, 0.0, 5.0, 9.0])
    assert batch_moments(values, torch.tensor([1.0, 1.0, 0.0, 0.0])).tolist() == [2.0, 1.0, 1.0]
    assert moments_std(torch.tensor([1.0, 3.0, 9.0], dtype=torch.float64)).item() == 0.0  # one value: no spread
    # group_advantages' statistics (with shaping) are over completion_returns; a given batch_std replaces the local one.
    shaping = torch.tensor([[0.2, 0.0, 0.0], [0.0, 0.0, 0.0], [0.1, 0.1, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    means = completion_returns(rewards, shaping, mask)  # [1 + .1, 0, .5 + .2/3, .5]
    torch.testing.assert_close(means, torch.tensor([1.1, 0.0, 0.5 + 0.2 / 3, 0.5], dtype=torch.float64))
    local = group_advantages(rewards, 2, token_shaping=shaping, mask=mask, scale="batch")
    given = group_advantages(rewards, 2, token_shaping=shaping, mask=mask, scale="batch",
                             batch_std=moments_std(batch_moments(means)))
    torch.testing.assert_close(given, local, rtol=0, atol=1e-15)
    halved = group_advantages(rewards, 2, token_shaping=shaping, mask=mask, scale="batch",
                              batch_std=2 * means.std() + 1e-6)
    torch.testing.assert_close(halved, local / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exactly_zero(scale):
    # float32 mean of eight 0.7s is not 0.7: without the explicit check this gives 0.056, not 0.
    rewards = torch.full((16,), 0.7)
    assert (group_advantages(rewards, 8, scale=scale) == 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_sum_to_zero(scale):
    rewards = torch.rand(6 * 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = group_advantages(rewards, 5, scale=scale).view(6, 5)
    torch.testing.assert_close(out.sum(dim=1), torch.zeros(6, dtype=torch.float64), rtol=0, atol=1e-12)


def test_group_scale_is_affine_invariant():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    base = group_advantages(rewards, 4, eps=0.0 + 1e-12)
    torch.testing.assert_close(group_advantages(3.0 * rewards - 7.0, 4, eps=1e-12), base, rtol=0, atol=1e-9)


def test_vectorised_equals_loop():
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = group_advantages(rewards, 6)
    for p in range(4):
        group = rewards[6 * p: 6 * p + 6].tolist()
        mean = sum(group) / 6
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 5)
        for g in range(6):
            assert out[6 * p + g].item() == pytest.approx((group[g] - mean) / (std + 1e-6), abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rewards=torch.ones(6), group_size=4), "not divisible by group_size 4"),
        (dict(rewards=torch.ones(6), group_size=1), "at least 2"),
        (dict(rewards=torch.ones(2, 3), group_size=3), r"shape \(2, 3\)"),
        (dict(rewards=torch.ones(4, dtype=torch.long), group_size=2), "floating-point"),
        (dict(rewards=torch.ones(4), group_size=2, scale="std"), "valid: group, batch, none"),
    ],
)
def test_group_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(**kwargs)


def test_shaped_reference_numbers():
    # G=2, T=3. Completion 0: R=1, shaping [.1,.1,0] on 3 tokens -> returns [1.1,1.1,1], mean 1.0666..
    # Completion 1: R=0, shaping [-.3,0,pad] on 2 tokens -> returns [-.3,0], mean -.15.
    # mu = (1.06667 - .15)/2 = .458333; std (Bessel, n-1=1) = |1.06667+.15|/sqrt(2) = .860297.
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    shaping = torch.tensor([[0.1, 0.1, 0.0], [-0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    out = group_advantages(rewards, 2, token_shaping=shaping, mask=mask)
    mu, sigma = (3.2 / 3 - 0.15) / 2, (3.2 / 3 + 0.15) / math.sqrt(2)
    expected = torch.tensor([[1.1 - mu, 1.1 - mu, 1.0 - mu], [-0.3 - mu, 0.0 - mu, 0.0]], dtype=torch.float64)
    expected[:, :] /= sigma + 1e-6
    expected[1, 2] = 0.0
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_shaped_with_zero_shaping_equals_group_advantages():
    rewards = torch.tensor(REWARDS)
    mask = (torch.rand(12, 7, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    for scale in ("group", "batch", "none"):
        out = group_advantages(rewards, 4, token_shaping=torch.zeros(12, 7), mask=mask, scale=scale)
        expected = group_advantages(rewards, 4, scale=scale)[:, None] * mask
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_shaped_flat_means_stay_unscaled():
    # Both completions have mean return 1.0 but their tokens differ by +-0.1: dividing by (0 + eps) would give
    # +-1e5. The group is left unscaled: advantages are G_i(t) - mu = +-0.1.
    rewards = torch.tensor([1.0, 1.0], dtype=torch.float64)
    shaping = torch.tensor([[0.1, -0.1], [0.0, 0.0]], dtype=torch.float64)
    out = group_advantages(rewards, 2, token_shaping=shaping, mask=torch.ones(2, 2, dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[0.1, -0.1], [0.0, 0.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    flat = group_advantages(torch.full((4,), 0.7), 4, token_shaping=torch.zeros(4, 3), mask=torch.ones(4, 3))
    assert (flat == 0).all()


def test_shaped_all_padding_row_is_finite():
    out = group_advantages(torch.tensor([1.0, 0.0]), 2, token_shaping=torch.zeros(2, 3),
                           mask=torch.tensor([[1.0, 1, 1], [0, 0, 0]]))
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_shaped_bad_shapes():
    with pytest.raises(ValueError, match=r"token_shaping has shape \(2, 3\) but mask has shape \(2, 4\)"):
        group_advantages(torch.ones(2), 2, token_shaping=torch.zeros(2, 3), mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"rewards has shape \(4,\)"):
        group_advantages(torch.ones(4), 2, token_shaping=torch.zeros(2, 3), mask=torch.ones(2, 3))
