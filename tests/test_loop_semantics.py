"""Settings that name an algorithm train that algorithm: GSPO's aggregation, eval-mode no-grad passes (no dropout
in the old and reference logprobs), one vocabulary on the engine's and the trainer's side, ppo_mini_batch_size
in verl's units, and the top-p/top-k warning. Each of these once trained something else without a message."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from grpo.config import ConfigError, check, startup_warnings
from launch.dist import DistInfo
from launch.recipe import load_config
from launch.train import run

REWARD = "tests_vowels"
PADDED_ROWS = 128  # output-projection rows beyond the tokenizer, as Qwen2.5's 151,936 rows for 151,665 tokens


def _rows(tmp_path):
    from data.rows import write_rows
    path = tmp_path / "rows.jsonl"
    write_rows([{"prompt": [{"role": "user", "content": f"Say something about the number {i}."}],
                 "data_source": REWARD, "reward_model": {"ground_truth": "{}"}, "extra_info": {"index": i}}
                for i in range(8)], path)
    return path


def _run_metrics(tmp_path, model_dir, *extra) -> list[dict]:
    """Three GRPO steps on one process with the transformers engine sharing the policy; the logged metrics."""
    cfg = load_config(None, [
        f"model.name_or_path={model_dir}", f"data.train_files=['{_rows(tmp_path)}']",
        f"reward.functions={{{REWARD}: 'rewards_for_tests:vowel_fraction'}}", "rollout.n=4",
        "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "optim.lr=1e-2",
        f"trainer.out_dir={tmp_path / 'runs'}", "trainer.run_name=semantics", "trainer.steps=3", *extra])
    run(cfg, DistInfo())
    lines = (tmp_path / "runs" / "semantics" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory):
    """The tiny Llama with PADDED_ROWS embedding rows that no token id of its tokenizer names."""
    from models import load_tokenizer
    from tiny import tiny_model
    tokenizer = load_tokenizer(None)
    directory = tmp_path_factory.mktemp("padded_vocab")
    tiny_model("llama", seed=0, vocab_size=len(tokenizer) + PADDED_ROWS).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_gspo_refuses_any_aggregation_but_its_sequence_mean():
    gspo = ["algorithm.ratio_level=sequence", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4"]
    # The default agg (token-mean) weights each sequence by its length: another objective than GSPO's.
    with pytest.raises(ConfigError, match=r"algorithm\.ratio_level=sequence \(GSPO\) with algorithm\.agg=token-mean"
                                          r".*set algorithm\.agg=seq-mean-token-mean"):
        check(load_config(None, gspo))
    with pytest.raises(ConfigError, match=r"algorithm\.agg=seq-mean-token-sum-norm"):
        check(load_config(None, gspo + ["algorithm.agg=seq-mean-token-sum-norm"]))
    check(load_config(None, gspo + ["algorithm.agg=seq-mean-token-mean"]))


def test_old_logprobs_are_taken_without_dropout(tmp_path, tiny_model_dir):
    # LoRA dropout 0.5 and two epochs (so an old-logprob pass runs). The engine samples in eval mode; the old
    # pass must score the same distribution, so the engine/trainer gap stays at float rounding (measured
    # 2-3e-7 here). With the old pass in train mode it was 0.17-0.19 from step 2 on (step 1: LoRA's B is 0).
    metrics = _run_metrics(tmp_path, tiny_model_dir, "model.lora.enabled=true", "model.lora.rank=4",
                           "model.lora.dropout=0.5", "algorithm.ppo_epochs=2")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["logprob_gap"] < 1e-5 for m in metrics), [m["logprob_gap"] for m in metrics]


def test_dropout_takes_the_old_logprob_pass_even_with_one_update():
    # old = current detached (the single-update shortcut) holds only when the update's pass is the eval pass.
    from models.logprobs import dropout_active, evaluating
    from models.lora import apply_lora
    from tiny import tiny_model
    model = tiny_model(vocab_size=256).train()
    assert not dropout_active(model)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.5, target_modules=["q_proj"], seed=0)
    assert dropout_active(model)
    with evaluating(model):
        assert not model.training
    assert model.training


def test_trainer_normalises_over_the_ids_the_engine_samples(tmp_path, padded_model_dir):
    # The engines never sample the padded rows and renormalise over the rest; a trainer normalising over all
    # rows was off by log(1 - their mass) on every token: logprob_gap 2.5-2.7e-3 here. Now float rounding only.
    metrics = _run_metrics(tmp_path, padded_model_dir)
    assert all(m["logprob_gap"] < 1e-5 for m in metrics), [m["logprob_gap"] for m in metrics]


def test_completion_logprobs_vocab_size_is_the_renormalised_distribution(padded_model_dir):
    from models import load_model
    from models.logprobs import completion_logprobs, pad_batch, sampleable_vocab_size
    from models import load_tokenizer
    model, tokenizer = load_model(str(padded_model_dir)), load_tokenizer(str(padded_model_dir))
    vocab = sampleable_vocab_size(model, tokenizer)
    assert vocab == len(tokenizer) == model.get_output_embeddings().weight.shape[0] - PADDED_ROWS
    batch = pad_batch([[1, 504, 3458], [1, 18]], [[40, 41, 42], [7, 8]], pad_id=2)
    with torch.no_grad():
        masked, _ = completion_logprobs(model, batch, vocab_size=vocab, temperature=0.7)
        full, _ = completion_logprobs(model, batch, temperature=0.7)
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits.float()
    # Reference: log_softmax over the first `vocab` rows of the temperature-scaled logits, at the positions
    # that predict each completion token (prompt_len - 1 + t).
    start = int(batch["prompt_len"]) - 1
    scaled = logits[:, start:start + 3] / 0.7
    labels = batch["input_ids"][:, start + 1:start + 4]
    expected = torch.log_softmax(scaled[..., :vocab], -1).gather(-1, labels[..., None])[..., 0]
    expected = expected * batch["completion_mask"]
    torch.testing.assert_close(masked, expected, rtol=0, atol=1e-5)
    # The difference is exactly -log(1 - padded mass) at each real token.
    padded_mass = torch.softmax(scaled, -1)[..., vocab:].sum(-1)
    torch.testing.assert_close(masked - full, -torch.log1p(-padded_mass) * batch["completion_mask"], rtol=0, atol=1e-5)
    assert float((masked - full).abs().max()) > 1e-4


def test_ppo_mini_batch_size_counts_prompts_over_all_ranks():
    # verl's ppo_mini_batch_size: prompts per optimizer step over all ranks; trainer.prompts_per_step is per rank.
    cfg = load_config(None, ["trainer.prompts_per_step=2", "rollout.n=4", "trainer.micro_batch_size=4",
                             "algorithm.ppo_mini_batch_size=2"])
    check(cfg, world_size=1)  # 1 rank: one mini-batch of its 2 prompts
    check(cfg, world_size=2)  # 2 ranks: 1 prompt per rank per mini-batch, 2 mini-batches
    with pytest.raises(ConfigError, match=r"algorithm\.ppo_mini_batch_size=2 \(prompts per optimizer step over all "
                                          r"8 ranks, as in verl\) must be a multiple of the world size 8"):
        check(cfg, world_size=8)
    big = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, ppo_mini_batch_size=256))
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=256 .* divides trainer\.prompts_per_step=2 .* "
                                          r"e\.g\. 16 for one optimizer step"):
        check(big, world_size=8)  # a verl value pasted in: 32 per rank, but only 2 prompts per rank


def test_top_p_without_truncated_is_warns_with_the_expected_gap(tmp_path, tiny_model_dir, capsys):
    assert startup_warnings(load_config(None, [])) == []
    assert startup_warnings(load_config(None, ["rollout.top_p=0.5", "algorithm.tis_cap=null"])) != []
    assert startup_warnings(load_config(None, ["stage=sft", "rollout.top_k=5"])) == []  # SFT samples nothing
    [warning] = startup_warnings(load_config(None, ["rollout.top_k=20"]))
    assert "rollout.top_k=20" in warning and "off-policy" in warning and "logprob_gap" in warning
    from launch.train import main
    code = main([f"model.name_or_path={tiny_model_dir}", f"data.train_files=['{_rows(tmp_path)}']",
                 f"reward.functions={{{REWARD}: 'rewards_for_tests:vowel_fraction'}}", "rollout.top_p=0.5",
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0 and "WARNING: rollout.top_p=0.5, rollout.top_k=0: the engine samples from the truncated" in err


def test_outcome_only_estimators_refuse_sentence_rewards_at_start_up():
    # RLOO and REINFORCE++ are defined for outcome rewards; sentence shaping would be refused at the first shaped
    # batch on one rank while the others wait in a collective, so start-up refuses it.
    for estimator in ("rloo", "reinforce_pp"):
        with pytest.raises(ConfigError, match=rf"algorithm\.adv_estimator={estimator} is defined for outcome "
                                              r"rewards only; set reward\.sentence_coef=0"):
            check(load_config(None, [f"algorithm.adv_estimator={estimator}"]))
        check(load_config(None, [f"algorithm.adv_estimator={estimator}", "reward.sentence_coef=0"]))
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss=cispo .* no algorithm\.dual_clip \(3\.0\)"):
        check(load_config(None, ["algorithm.policy_loss=cispo", "algorithm.dual_clip=3"]))
