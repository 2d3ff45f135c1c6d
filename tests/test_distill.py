"""On-policy distillation: the per-token advantage against hand-derived numbers, the estimator that leaves the
teacher's signal alone, a teacher equal to the student (exactly 0 advantage and 0 gradient through the whole
loop, and a different teacher that does move the weights), and the start-up refusals. 2 ranks = 1 process for a
distillation step is a case of tests/test_loop_invariance.py."""
import pytest
import torch
from safetensors.torch import load_file

from grpo.advantages import compute_advantages, distill_advantages
from grpo.config import ConfigError, check
from launch.dist import DistInfo
from launch.recipe import load_config
from loop_harness import case_overrides, run_case, write_rows


def test_distill_advantages_by_hand():
    # teacher - student per token: [-0.25 - -1.0, -3.0 - -0.5, -0.1 - -0.1] = [0.75, -2.5, 0], times coef 0.4;
    # row 2 has one real token: -2.0 - -4.0 = 2.0 -> 0.8, padding 0 (and never -0).
    teacher = torch.tensor([[-0.25, -3.0, -0.1], [-2.0, -7.0, -1.0]])
    student = torch.tensor([[-1.0, -0.5, -0.1], [-4.0, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    got = distill_advantages(teacher, student, mask, 0.4)
    expected = torch.tensor([[0.3, -1.0, 0.0], [0.8, 0.0, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    assert not torch.signbit(got[1, 1:]).any()
    assert torch.equal(distill_advantages(student, student, mask, 3.0), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"student_logprobs has shape \(2, 2\) but teacher_logprobs has shape"):
        distill_advantages(teacher, student[:, :2], mask, 1.0)


def test_none_estimator_is_zero_and_refuses_sentence_rewards():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert torch.equal(compute_advantages("none", torch.tensor([1.0, 0.0]), torch.zeros(2, 2), mask, 2),
                       torch.zeros(2, 2))
    with pytest.raises(ValueError, match="adv_estimator=none is defined for outcome rewards only"):
        compute_advantages("none", torch.tensor([1.0, 0.0]), torch.ones(2, 2), mask, 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from models import load_tokenizer
    from tiny import tiny_model

    root = tmp_path_factory.mktemp("distill")
    write_rows(root / "rows.jsonl")
    other = root / "other_teacher"  # the same architecture and tokenizer, other random weights
    tiny_model("llama", seed=1).save_pretrained(other)
    load_tokenizer(None).save_pretrained(other)
    return root, tiny_model_dir, other


def _step(setup, teacher, *extra):
    root, model_dir, _ = setup
    overrides = case_overrides("plain", 1, model_dir, root / "rows.jsonl", root / "runs",
                               f"algorithm.teacher={teacher}", "algorithm.adv_estimator=none",
                               "reward.sentence_coef=0", *extra)
    return run_case(overrides, DistInfo())


def test_teacher_equal_to_student_gives_zero_advantage_and_gradient(setup):
    root, model_dir, other = setup
    initial = load_file(str(model_dir / "model.safetensors"))
    weights, metrics = _step(setup, model_dir)
    assert metrics[0]["distill_reverse_kl"] == 0.0
    assert all(torch.equal(weights[name], initial[name]) for name in initial)  # SGD: zero gradient, no move
    # The same step with another teacher moves the weights: the test above can fail.
    weights, metrics = _step(setup, other, "trainer.run_name=other_teacher")
    assert abs(metrics[0]["distill_reverse_kl"]) > 0.1
    assert max(float((weights[name] - initial[name]).abs().max()) for name in initial) > 1e-3


def test_flat_groups_are_no_warning_with_a_teacher():
    from grpo.trainer import NoSignalWatch

    flat = {"flat_group_frac": 1.0, "truncation_rate": 0.6}  # every group flat, truncation above its threshold
    common = ["trainer.warn_truncation=0.5", "trainer.warn_after_steps=1", "algorithm.teacher=any",
              "algorithm.adv_estimator=none", "reward.sentence_coef=0"]
    assert [w.split(" = ")[0] for w in NoSignalWatch(load_config(None, common)).update(flat, 1)] == ["truncation_rate"]
    without = NoSignalWatch(load_config(None, common + ["algorithm.teacher=null", "algorithm.adv_estimator=grpo"]))
    assert len(without.update(flat, 1)) == 3  # zero signal, truncation, flat groups


def test_refusals(setup, tmp_path, monkeypatch):
    from models import load_tokenizer
    from tiny import tiny_model

    root, model_dir, _ = setup
    with pytest.raises(ConfigError, match=r"adv_estimator=none trains on distillation alone: it needs "
                                          r"algorithm.teacher \(got None\)"):
        check(load_config(None, ["algorithm.adv_estimator=none", "reward.sentence_coef=0"]))
    with pytest.raises(ConfigError, match="and no algorithm.dynamic_sampling"):
        check(load_config(None, ["algorithm.adv_estimator=none", "reward.sentence_coef=0", "algorithm.teacher=t",
                                 "algorithm.dynamic_sampling=true"]))
    foreign = tmp_path / "foreign_tokenizer"
    tiny_model("llama", seed=0).save_pretrained(foreign)
    tokenizer = load_tokenizer(None)
    tokenizer.add_tokens(["<not_in_the_student>"])
    tokenizer.save_pretrained(foreign)
    with pytest.raises(ConfigError, match=r"algorithm.teacher=.*foreign_tokenizer: its tokenizer differs from the "
                                          r"student's \(model.name_or_path=.*\): 49153 against 49152 entries"):
        _step(setup, foreign, "trainer.run_name=foreign")
    with pytest.raises(ConfigError, match="algorithm.teacher: .*missing"):
        _step(setup, tmp_path / "missing", "trainer.run_name=missing")
    monkeypatch.chdir(tmp_path)  # a fresh clone: make demo has not run
    with pytest.raises(ConfigError, match=r"runs/demo/grpo/checkpoints/step_6 does not exist.* \(made by: make demo\)"):
        _step(setup, "runs/demo/grpo/checkpoints/step_6", "trainer.run_name=not_made")
