"""End to end on a tiny random model with the transformers engine: GRPO and SFT steps, run directory,
checkpoints, resume equivalence, start-up errors."""
import dataclasses
import json
import shutil

import pytest
import torch

from grpo.config import ConfigError
from launch.recipe import load_config
from launch.dist import DistInfo
from launch.train import run

REWARD = "tests_vowels"


def _rows(tmp_path, n=8, data_source=REWARD):
    from data.rows import write_rows
    rows = [{"prompt": [{"role": "user", "content": f"Say something about the number {i}."}], "data_source": data_source,
             "ability": "test", "reward_model": {"ground_truth": "{}"},
             "extra_info": {"index": i, "split": "train", "target": f"The number {i} is nice."}} for i in range(n)]
    path = tmp_path / "rows.jsonl"
    write_rows(rows, path)
    return path


def _config(tmp_path, model_dir, *extra):
    rows = _rows(tmp_path)
    return load_config(None, [
        f"model.name_or_path={model_dir}", f"data.train_files=['{rows}']", f"data.eval_files=['{rows}']",
        "data.eval_size=2", f"reward.functions={{{REWARD}: 'rewards_for_tests:vowel_fraction'}}",
        "rollout.n=4", "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
        "optim.lr=1e-3", f"trainer.out_dir={tmp_path / 'runs'}", "trainer.run_name=e2e", *extra])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_two_steps_and_resume_equivalence(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    cfg = _config(tmp_path, tiny_model_dir, "trainer.steps=4", "trainer.save_every=2", "algorithm.kl_coef=0.01",
                  "algorithm.ppo_epochs=2", "algorithm.dual_clip=3")
    summary = run(cfg, DistInfo())
    run_dir = tmp_path / "runs" / "e2e"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert all(isinstance(m[k], float) and m[k] == m[k] for k in ("reward_mean", "grad_norm", "kl", "entropy"))
        assert m["ratio_first_update"] == pytest.approx(1.0, abs=1e-5)  # old logprobs pass == first update pass
    assert (run_dir / "samples.jsonl").exists() and (run_dir / "config.yaml").exists()
    assert set(summary["after"]["means"]) >= {"reward", "acc", "format"} and summary["after"]["count"] == 2
    assert len(summary["after"]["values"]["reward"]) == 2  # per-prompt values, for paired comparisons
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    final = load_file(str(run_dir / "checkpoints" / "step_4" / "model.safetensors"))
    changed = [k for k in initial if not torch.equal(initial[k], final[k])]
    assert len(changed) == len(initial), f"parameters unchanged after 4 steps: {set(initial) - set(changed)}"

    # Resume from step 2 as if the run had died after it: steps 3-4 must reproduce exactly.
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    run(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="always")), DistInfo())
    resumed = _metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for before, after in zip(metrics[2:], resumed[2:]):
        for key in before:
            if not key.startswith(("time_", "tokens_per_s", "sync/")):
                assert before[key] == after[key], (key, before[key], after[key])


def test_a_fresh_run_in_a_used_directory_replaces_its_logs(tmp_path, tiny_model_dir):
    """resume=never starts at step 0: the metrics and samples of an earlier run there are replaced, not appended
    (with trainer.overwrite, which a directory holding an earlier run's checkpoints needs)."""
    cfg = _config(tmp_path, tiny_model_dir, "trainer.steps=2", "data.eval_files=[]", "trainer.overwrite=true")
    run_dir = tmp_path / "runs" / "e2e"

    def sample_steps():
        return [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]

    run(cfg, DistInfo())
    first = sample_steps()
    run(cfg, DistInfo())
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
    assert sample_steps() == first and sorted(set(first)) == [1, 2]


def test_a_fresh_run_never_continues_or_mixes_with_an_earlier_runs_checkpoints(tmp_path, tiny_model_dir):
    """An earlier 3-step run's step_3 beside a new 2-step run's step_2 made a later --resume continue the earlier
    run's weights: a fresh start in a directory holding checkpoints is refused, naming the ways on; with
    trainer.overwrite the earlier checkpoints go and a resume continues the new run."""
    from models.checkpoint import complete_checkpoints
    run_dir = tmp_path / "runs" / "e2e"
    run(_config(tmp_path, tiny_model_dir, "trainer.steps=3", "data.eval_files=[]"), DistInfo())
    other = ["trainer.steps=2", "data.eval_files=[]", "reward.functions={tests_vowels: 'rewards_for_tests:constant'}"]
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(up to step_3\): continue it with "
                                          r"--resume .* another trainer\.run_name, or set trainer\.overwrite=true"):
        run(_config(tmp_path, tiny_model_dir, *other), DistInfo())
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3]  # nothing of the refused run was written
    run(_config(tmp_path, tiny_model_dir, *other, "trainer.overwrite=true"), DistInfo())
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2]


def test_a_resume_refuses_settings_that_define_another_run(tmp_path, tiny_model_dir):
    """Resuming with another rollout.n, trainer.prompts_per_step or optim.lr was accepted and config.yaml
    overwritten: the differences are refused, naming each key and both values, unless listed in
    trainer.resume_changes; every resume's settings are kept beside the first."""
    run_dir = tmp_path / "runs" / "e2e"
    run(_config(tmp_path, tiny_model_dir, "trainer.steps=2", "data.eval_files=[]", "trainer.save_every=1"), DistInfo())
    first = (run_dir / "config.yaml").read_text()
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    changed = ["trainer.steps=2", "data.eval_files=[]", "rollout.n=2", "trainer.prompts_per_step=4", "optim.lr=0.5"]
    with pytest.raises(ConfigError, match=r"resuming .*step_1: settings differ from the run's \(.*config\.yaml\): "
                                          r"rollout\.n: 4 -> 2; optim\.lr: 0\.001 -> 0\.5; "
                                          r"trainer\.prompts_per_step: 2 -> 4\. List the ones"):
        run(_config(tmp_path, tiny_model_dir, *changed, "trainer.resume=always"), DistInfo())
    run(_config(tmp_path, tiny_model_dir, "trainer.steps=3", "data.eval_files=[]", "optim.lr=0.5",
                "trainer.resume_changes=[optim.lr]", "trainer.resume=always"), DistInfo())  # steps may grow freely
    assert (run_dir / "config.yaml").read_text() == first
    assert "lr: 0.5" in (run_dir / "config_step_1.yaml").read_text()
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3]


def test_what_a_user_sees_of_a_run_and_its_resume(tmp_path, tiny_model_dir, capsys):
    """Issue 31, finding 9, each checked here and absent on 5cd6fe9: data.train_files=/one/file.jsonl is a one-file
    list; RL steps log their loss; a reward without a format component adds no format column; the summary on
    stdout is the run directory and the held-out means only; a resume says where it resumed from."""
    from launch.train import main
    rows = _rows(tmp_path)
    base = [f"model.name_or_path={tiny_model_dir}", f"data.train_files={rows}", f"data.eval_files={rows}",
            "data.eval_size=2", f"reward.functions={{{REWARD}: 'rewards_for_tests:constant'}}", "rollout.n=2",
            "rollout.max_new_tokens=4", f"trainer.out_dir={tmp_path / 'runs'}", "trainer.run_name=seen"]
    assert main(base + ["trainer.steps=1"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert set(summary) == {"run_dir", "before", "after"} and set(summary["after"]) == {"reward", "acc"}
    metrics = _metrics(tmp_path / "runs" / "seen")
    assert isinstance(metrics[0]["loss"], float) and not any("format" in key for key in metrics[0])
    assert main(base + ["trainer.steps=2", "--resume"]) == 0
    assert f"resumed from {tmp_path / 'runs' / 'seen' / 'checkpoints' / 'step_1'} (step 1 of 2)" in capsys.readouterr().err


def test_sentence_rewards_shape_token_advantages(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, "trainer.steps=2", "data.eval_files=[]",
                  f"reward.functions={{{REWARD}: 'rewards_for_tests:vowel_sentences'}}", "reward.sentence_coef=2.0")
    run(cfg, DistInfo())
    metrics = _metrics(tmp_path / "runs" / "e2e")
    assert len(metrics) == 2 and all(m["shaped_token_frac"] > 0.5 for m in metrics)


def test_sft_steps_lower_the_loss(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, "stage=sft", "trainer.steps=6", "trainer.sft_batch_size=4",
                  "data.eval_files=[]", "optim.lr=3e-3")
    run(cfg, DistInfo())
    losses = [m["loss"] for m in _metrics(tmp_path / "runs" / "e2e")]
    assert losses[-1] < losses[0] * 0.8, losses


def test_sft_held_out_evaluation_uses_the_trained_weights(tmp_path, tiny_model_dir):
    # An engine with weights of its own (here a bf16 copy beside fp32 master weights; under torchrun always) must
    # receive the SFT steps' weights before it scores the held-out rows after them, as RL's sync after every step
    # does: its weights are then the trained policy's in its dtype, not the ones it was built with.
    from grpo.trainer import train_sft
    from launch.build import build
    cfg = _config(tmp_path, tiny_model_dir, "stage=sft", "trainer.steps=2", "trainer.sft_batch_size=4",
                  "optim.lr=1e-2", "model.param_dtype=bfloat16")
    built = build(cfg, DistInfo())
    try:
        engine = built.parts.rollout.engine
        assert not engine.shared and engine.model.dtype == torch.bfloat16
        built.loop(built.parts, DistInfo())
        trained = dict(built.parts.policy.model.named_parameters())
        for name, weight in engine.model.named_parameters():
            assert torch.equal(weight, trained[name].detach().to(torch.bfloat16)), name
        assert train_sft is built.loop
    finally:
        built.close()


def test_startup_errors_write_nothing(tmp_path, tiny_model_dir):
    (tmp_path / "unknown").mkdir()
    cases = [
        (["data.train_files=['/nonexistent/rows.jsonl']"], "data.train_files: file not found: /nonexistent/rows.jsonl"),
        (["rollout.n=1"], "rollout.n=1"),
        (["trainer.micro_batch_size=3"], "trainer.micro_batch_size=3 does not divide"),
        (["data.max_prompt_tokens=5"], "longer than data.max_prompt_tokens=5"),
        ([f"data.train_files=['{_rows(tmp_path / 'unknown', data_source='no_such_reward')}']"],
         "data_source 'no_such_reward' with no reward function"),
    ]
    for overrides, message in cases:
        cfg = _config(tmp_path, tiny_model_dir, *overrides)
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
            run(cfg, DistInfo())
        assert not (tmp_path / "runs").exists()


def test_lora_grpo_uses_adapters_off_as_reference(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    cfg = _config(tmp_path, tiny_model_dir, "trainer.steps=2", "data.eval_files=[]", "algorithm.kl_coef=0.1",
                  "model.lora.enabled=true", "model.lora.rank=4", "model.lora.merged_export=true", "optim.lr=1e-2")
    run(cfg, DistInfo())
    metrics = _metrics(tmp_path / "runs" / "e2e")
    assert metrics[0]["kl"] == 0.0  # step 1: adapters start at B = 0, so policy == reference exactly
    assert metrics[1]["kl"] > 0.0  # step 2: the adapters moved the policy away from the reference
    step = tmp_path / "runs" / "e2e" / "checkpoints" / "step_2"
    assert (step / "adapter_model.safetensors").exists() and (step / "COMPLETE").exists()
    merged = AutoModelForCausalLM.from_pretrained(step / "merged")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 5, 9, 200]])
    assert not torch.allclose(merged(ids).logits, initial(ids).logits)
