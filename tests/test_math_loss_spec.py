"""One loss entry point: the algorithm section's checks, rl_loss (policy loss + KL + entropy, truncated IS, metrics) against
hand-derived numbers, micro-batching that leaves the gradient unchanged, and CISPO's loss and gradient."""
import math

import pytest
import torch

from grpo.config import AGGREGATIONS, POLICY_LOSSES, AlgorithmConfig, ConfigError, check_algorithm
from grpo.losses import loss_denominator, policy_loss, rl_loss

F64 = dict(dtype=torch.float64)
# The batch of tests/test_math_losses.py: 2 sequences of 3 and 5 tokens, A = +1 and -0.5.
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], **F64)
OLD = torch.tensor([[-1, -0.5, -2, 0, 0], [-1.2, -0.7, -3, -0.4, -2.5]], **F64)
NEW = torch.tensor([[-0.9, -0.3, -1.6, 0, 0], [-1.5, -0.8, -3, -0.1, -1.1]], **F64)
ADV = torch.tensor([1.0, -0.5], **F64)
E = math.exp


def _random_batch(seed: int, step: float, size: int = 6, tokens: int = 7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(size, tokens, generator=gen, **F64) * 3
    new = old + step * torch.randn(size, tokens, generator=gen, **F64)
    advantages = torch.randn(size, tokens, generator=gen, **F64)
    mask = (torch.rand(size, tokens, generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    return old, new, advantages, mask


def test_names():
    assert POLICY_LOSSES == ("ppo", "cispo")
    assert AGGREGATIONS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("fields, message", [
    (dict(policy_loss="grpo"), "algorithm.policy_loss: 'grpo' is not one of ppo, cispo"),
    (dict(agg="mean"), "is not one of token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"),
    (dict(ratio_level="seq"), "algorithm.ratio_level: 'seq' is not one of token, sequence"),
    (dict(kl_kind="k4"), "algorithm.kl_kind: 'k4' is not one of"),
    (dict(tis_level="batch"), "algorithm.tis_level: 'batch' is not one of"),
    (dict(clip_low=1.0), r"algorithm\.clip_low=1\.0 is out of range: it must be in \[0, 1\)"),
    (dict(dual_clip=1.0), r"algorithm\.dual_clip=1\.0 is out of range: it must be > 1"),
    (dict(kl_coef=-0.1), r"algorithm\.kl_coef=-0\.1 is out of range: it must be >= 0"),
    (dict(entropy_coef=-1.0), r"algorithm\.entropy_coef=-1\.0 is out of range: it must be >= 0"),
    (dict(tis_cap=0.0), r"algorithm\.tis_cap=0\.0 is out of range: it must be > 0"),
    (dict(cispo_clip_low=1.5), r"algorithm\.cispo_clip_low=1\.5 is out of range: it must be in \[0, 1\]"),
    (dict(policy_loss="cispo", dual_clip=3.0), r"it takes no algorithm\.dual_clip \(3\.0\)"),
    (dict(policy_loss="cispo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
     r"and ratio_level token \(got sequence\)"),
])
def test_the_algorithm_section_refuses(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_algorithm(AlgorithmConfig(**fields))


def test_the_algorithm_section_is_frozen_and_defaults_to_the_plain_clipped_surrogate():
    spec = AlgorithmConfig()
    assert (spec.policy_loss, spec.clip_low, spec.clip_high, spec.agg, spec.kl_coef, spec.tis_cap) == \
        ("ppo", 0.2, 0.2, "token-mean", 0.0, None)
    with pytest.raises(AttributeError):
        spec.kl_coef = 0.1  # type: ignore[misc]
    assert policy_loss(NEW, OLD, ADV, MASK)[0].item() == policy_loss(NEW, OLD, ADV, MASK, spec)[0].item()


def test_rl_loss_reference_numbers_with_kl_and_entropy():
    # Policy term: clip 0.2 / 0.28, dual clip 3, token-mean = -0.0099031954 (tests/test_math_losses.py derives it).
    # KL k1 with ref = new - 0.1: 0.1 on every token, coefficient 0.5 -> +0.05.
    # Entropy [1, 2, 3 | .5 x 5] over the 8 masked tokens: (6 + 2.5) / 8 = 1.0625, coefficient 0.01 -> -0.010625.
    # Total -0.0099031954 + 0.05 - 0.010625 = 0.0294718046.
    spec = AlgorithmConfig(clip_high=0.28, dual_clip=3.0, kl_coef=0.5, kl_kind="k1", entropy_coef=0.01)
    entropy = torch.tensor([[1, 2, 3, 9, 9], [0.5] * 5], **F64)
    loss, metrics = rl_loss(spec, NEW, OLD, ADV, MASK, denominator=8.0, ref_logprobs=NEW - 0.1, entropy=entropy)
    assert loss.item() == pytest.approx(0.029471804571270473, abs=1e-15)
    assert metrics["kl"] == pytest.approx(0.1, abs=1e-15) and metrics["entropy"] == 1.0625
    assert all(type(value) is float for value in metrics.values())
    assert set(metrics) == {"clip_frac_upper", "clip_frac_lower", "clip_frac_dual", "approx_kl", "ratio_mean",
                            "ratio_max", "kl", "entropy"}
    # kl_coef 0 (and entropy_coef 0): the metrics are still read, the loss is the policy term alone.
    plain, metrics = rl_loss(AlgorithmConfig(clip_high=0.28, dual_clip=3.0), NEW, OLD, ADV, MASK, denominator=8.0,
                             ref_logprobs=NEW - 0.1, entropy=entropy)
    assert plain.item() == policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(clip_high=0.28, dual_clip=3.0))[0].item()
    assert "kl" in metrics and "entropy" in metrics


def test_rl_loss_reference_numbers_with_truncated_is():
    # old - rollout = [.1, -1, 1.5 | 0 x 5]; cap 2: weights e^.1, e^-1, 2 (e^1.5 capped) | 1 x 5.
    # Token losses (clip .2/.28, dual 3): seq 1 -e^.1, -e^.2, -1.28 times its weights: -e^.2, -e^-.8, -2.56;
    # seq 2 .4, .5 e^-.1, .5, .5 e^.3, 1.5 unchanged. token-mean: their sum / 8 = -0.0879229512.
    # tis_weight_mean (e^.1 + e^-1 + 2 + 5) / 8; tis_clip_frac 1/8; logprob_gap (.1 + 1 + 1.5) / 8 = .325.
    spec = AlgorithmConfig(clip_high=0.28, dual_clip=3.0, tis_cap=2.0)
    rollout = OLD - torch.tensor([[0.1, -1, 1.5, 0, 0], [0] * 5], **F64)
    loss, metrics = rl_loss(spec, NEW, OLD, ADV, MASK, denominator=8.0, rollout_logprobs=rollout)
    seq2 = 0.4 + 0.5 * E(-0.1) + 0.5 + 0.5 * E(0.3) + 1.5
    assert loss.item() == pytest.approx((-E(0.2) - E(-0.8) - 2.56 + seq2) / 8, abs=1e-15)
    assert metrics["tis_weight_mean"] == pytest.approx((E(0.1) + E(-1) + 7) / 8, abs=1e-15)
    assert metrics["tis_clip_frac"] == 1 / 8 and metrics["logprob_gap"] == pytest.approx(0.325, abs=1e-15)
    with pytest.raises(ValueError, match="tis_cap is set but rollout_logprobs is None"):
        rl_loss(spec, NEW, OLD, ADV, MASK, denominator=8.0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode", POLICY_LOSSES)
def test_rl_loss_micro_batches_with_the_step_denominator_equal_the_full_batch(agg, mode):
    old, new, advantages, mask = _random_batch(seed=2, step=0.3)
    ref, entropy = old + 0.2, torch.rand(old.shape, generator=torch.Generator().manual_seed(3), **F64)
    spec = AlgorithmConfig(policy_loss=mode, clip_high=0.28, agg=agg, kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5)
    max_len = 7 if agg == "seq-mean-token-sum-norm" else None
    rollout = old + 0.05
    full = new.clone().requires_grad_(True)
    denominator = loss_denominator(mask, agg)
    rl_loss(spec, full, old, advantages, mask, denominator=denominator, max_len=max_len, rollout_logprobs=rollout,
            ref_logprobs=ref, entropy=entropy)[0].backward()
    micro = new.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        rl_loss(spec, micro[rows], old[rows], advantages[rows], mask[rows], denominator=denominator, max_len=max_len,
                rollout_logprobs=rollout[rows], ref_logprobs=ref[rows], entropy=entropy[rows])[0].backward()
    torch.testing.assert_close(micro.grad, full.grad, rtol=0, atol=1e-15)


def test_cispo_reference_numbers_and_gradient():
    # CISPO, weight w = sg(min(rho, 1 + .3)) (no lower bound), token loss -w * A * logp (logp = NEW):
    # seq 1 (A = +1): rho e^.1, e^.2, e^.4 -> w 1.10517, 1.22140, 1.3 (capped): w * |logp| = 1.10517 * .9,
    #   1.22140 * .3, 1.3 * 1.6 = .994654, .366421, 2.08 (sum 3.441075);
    # seq 2 (A = -.5): rho e^-.3, e^-.1, 1, e^.3, e^1.4 -> w .740818, .904837, 1, 1.3, 1.3 (both capped):
    #   .5 * w * logp = -.555614, -.361935, -1.5, -.065, -.715 (sum -3.197549).
    # token-mean (3.441075 - 3.197549) / 8 = .0304408; seq-mean-token-mean (3.441075 / 3 - 3.197549 / 5) / 2.
    seq1 = [E(0.1) * 0.9, E(0.2) * 0.3, 1.3 * 1.6]
    seq2 = [-0.75 * E(-0.3), -0.4 * E(-0.1), -1.5, -0.065, -0.715]
    spec = AlgorithmConfig(policy_loss="cispo", cispo_clip_high=0.3)
    logprobs = NEW.clone().requires_grad_(True)
    loss, metrics = policy_loss(logprobs, OLD, ADV, MASK, spec)
    assert loss.item() == pytest.approx((sum(seq1) + sum(seq2)) / 8, abs=1e-15)
    assert loss.item() == pytest.approx(0.0304407526238, abs=1e-12)
    seq_mean = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(policy_loss="cispo", cispo_clip_high=0.3, agg="seq-mean-token-mean"))
    assert seq_mean[0].item() == pytest.approx((sum(seq1) / 3 + sum(seq2) / 5) / 2, abs=1e-15)
    # Gradient -A * w / 8 on every masked token, the capped ones too (PPO's clip gives those 0): the weight is
    # detached, so only logp carries the gradient.
    loss.backward()
    weights = torch.tensor([[E(0.1), E(0.2), 1.3, 0, 0], [E(-0.3), E(-0.1), 1, 1.3, 1.3]], **F64)
    torch.testing.assert_close(logprobs.grad, -ADV[:, None] * weights * MASK / 8, rtol=0, atol=1e-15)
    # The cap changes the weight of seq 1 token 3 and seq 2 tokens 4, 5: 3 of 8; no lower bound, no dual clip.
    assert metrics["clip_frac_upper"].item() == 3 / 8
    assert metrics["clip_frac_lower"].item() == 0.0 and metrics["clip_frac_dual"].item() == 0.0
    # A lower bound .2 (verl's form, PPO-sized bounds) lifts seq 2 token 1's weight to .8: .5 * .8 * -1.5 = -.6.
    low, metrics = policy_loss(NEW, OLD, ADV, MASK, AlgorithmConfig(policy_loss="cispo", cispo_clip_low=0.2, cispo_clip_high=0.3))
    assert low.item() == pytest.approx((sum(seq1) + sum(seq2) - seq2[0] - 0.6) / 8, abs=1e-15)
    assert metrics["clip_frac_lower"].item() == 1 / 8


def test_cispo_default_cap_and_is_weights():
    # Default cispo_clip_high 4: the weight is capped at 5; e^1.4 = 4.06 passes, e^2 = 7.39 does not.
    logprobs = torch.tensor([[-1.0, -1.0]], **F64, requires_grad=True)
    old = torch.tensor([[-2.4, -3.0]], **F64)
    loss, _ = policy_loss(logprobs, old, torch.tensor([1.0], **F64), torch.ones(1, 2, **F64), AlgorithmConfig(policy_loss="cispo"))
    assert loss.item() == pytest.approx((E(1.4) + 5.0) / 2, abs=1e-14)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-E(1.4) / 2, -5.0 / 2]], **F64), rtol=0, atol=1e-15)
    spec = AlgorithmConfig(policy_loss="cispo", cispo_clip_high=0.3)
    weighted, _ = policy_loss(NEW, OLD, ADV, MASK, spec, is_weights=torch.full_like(MASK, 0.5))
    assert weighted.item() == pytest.approx(0.5 * policy_loss(NEW, OLD, ADV, MASK, spec)[0].item(), abs=1e-15)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_cispo_on_policy_gradient_is_the_ppo_reinforce_gradient(agg):
    # At rho = 1 nothing is capped and w = 1: d(-w A logp) = -A d logp, PPO's d(-A rho) = -A rho d logp.
    old, _, advantages, mask = _random_batch(seed=5, step=0.0)
    max_len = 7 if agg == "seq-mean-token-sum-norm" else None
    grads = {}
    for mode in POLICY_LOSSES:
        logprobs = old.clone().requires_grad_(True)
        policy_loss(logprobs, old, advantages, mask, AlgorithmConfig(policy_loss=mode, agg=agg),
                    max_len=max_len)[0].backward()
        grads[mode] = logprobs.grad
    torch.testing.assert_close(grads["cispo"], grads["ppo"], rtol=0, atol=1e-15)
    if agg == "token-mean":
        torch.testing.assert_close(grads["cispo"], -advantages * mask / mask.sum(), rtol=0, atol=1e-15)
