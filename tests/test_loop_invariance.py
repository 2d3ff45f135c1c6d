"""World size and micro-batching do not change an RL step, shown through grpo.trainer.train_rl itself (not just
the loss function): the run is built by launch.build, then the engine is replaced by a scripted one whose
completions depend only on the prompt, so both sides train on the same groups, and AdamW by SGD (see
loop_harness.sgd_policy: comparing weights then compares gradients).

One process x 4 prompts is compared with 2 ranks x 2 prompts (ONE torchrun launch of tests/dist_invariance.py
runs every case) for: the plain step, adv_estimator=batch_std (the std is all-reduced), sentence shaping, dynamic
sampling with filler groups, LoRA, 2 PPO mini-batches x 2 epochs with KL and entropy terms, GSPO with the KL
in the reward over 2 steps, token-budget micro-batches, REINFORCE++ (whitened over every rank's tokens),
RLOO with CISPO over 2 epochs, and on-policy distillation over 2 steps; and on one process, micro-batches of 2 vs 8 rows
and token budgets of 64 and 256 vs one micro-batch.
"""
import functools

import pytest
import torch
from safetensors.torch import load_file

from launch.dist import DistInfo
from loop_harness import CASES, case_overrides, run_case, write_rows
from tests_support import torchrun_results

# Weights are ~0.1 and move by 0.5 * gradient; float32 sums in another order (ranks, micro-batches) differ by
# a few ulps of the gradient, far below this. A wrong denominator or a per-rank statistic moves them by
# ~1e-3 or more (checked: every case below moves its trained weights by more than MOVED).
TOLERANCE, MOVED = 1e-6, 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("invariance")
    rows = root / "rows.jsonl"
    write_rows(rows)
    return root, rows, tiny_model_dir


@functools.lru_cache(maxsize=None)
def _one_process(root, rows, model_dir, case, extra):
    return run_case(case_overrides(case, 1, model_dir, rows, root / "runs", *extra), DistInfo())


def one_process(setup, case, *extra):
    """(weights, metrics) of `case` on one process with 4 prompts (each run once per session)."""
    return _one_process(*setup, case, extra)


@pytest.fixture(scope="module")
def initial(tiny_model_dir):
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def two_ranks(setup):
    root, rows, model_dir = setup
    out = root / "dist"
    out.mkdir()
    results = torchrun_results("dist_invariance.py", out, str(model_dir), str(rows), timeout=600)
    return out, results


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def moved(weights: dict, initial: dict) -> float:
    return max(float((weights[k] - initial[k]).abs().max()) for k in initial if k in weights)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(case, setup, two_ranks, initial):
    out, results = two_ranks
    assert results["world_size"] == 2
    reference, metrics = one_process(setup, case)
    sharded = load_file(str(out / f"{case}.safetensors"))
    if case != "lora":
        assert moved(reference, initial) > MOVED, case
    assert max_diff(sharded, reference) <= TOLERANCE, (case, max_diff(sharded, reference))
    steps = results[case]
    assert len(steps) == len(metrics) and steps[-1]["ratio_first_update"] == pytest.approx(1.0, abs=1e-6)
    if case == "dynamic":  # rows 0 and 2 of rows 0-3 are filler groups (weight 0), on both sides
        assert metrics[-1]["kept_group_frac"] == 0.5 and steps[-1]["kept_group_frac"] == 0.5
    if case == "lora":  # only adapters train; B starts at 0, so one step moves B and leaves the base as it was
        base = {k: v for k, v in reference.items() if "lora_" not in k}
        assert all(torch.equal(v, initial[k.replace(".base_layer", "")]) for k, v in base.items())
        assert max(float(v.abs().max()) for k, v in reference.items() if "lora_B" in k) > MOVED
    if case == "gspo_kl_in_reward":  # step 2's reward carries a non-zero KL to the starting model (the logged
        # value is a mean of per-rank token means, so it is close to the one process's, not equal)
        assert steps[-1]["kl"] > 0.1 and steps[-1]["kl"] == pytest.approx(metrics[-1]["kl"], rel=0.05)
    if case == "distill":  # the teacher is the start: no signal before the first update, some after it
        assert [s["distill_reverse_kl"] for s in (metrics[0], steps[0])] == [0.0, 0.0]
        # (scripted completions are not the student's samples, so the estimate's sign is not fixed)
        assert min(abs(metrics[1]["distill_reverse_kl"]), abs(steps[1]["distill_reverse_kl"])) > 1e-3


def test_micro_batches_and_token_budgets_do_not_change_the_step(setup, initial):
    reference, _ = one_process(setup, "plain")  # micro-batches of 8 rows
    assert moved(reference, initial) > MOVED
    for extra in (["trainer.micro_batch_size=2"], ["trainer.micro_batch_size=16"],
                  ["trainer.max_tokens_per_micro_batch=64"], ["trainer.max_tokens_per_micro_batch=256"]):
        weights, _ = one_process(setup, "plain", *extra)
        assert max_diff(weights, reference) <= TOLERANCE, (extra, max_diff(weights, reference))
