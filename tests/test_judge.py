"""reward.model: a verifier checkpoint as the reward of an RL run (grpo/judge.py). The judge's reward on fixed
(question, reference, candidate) rows equals what launch.eval's offline judgments of the same checkpoint give, for
a verifier SFT-trained here until its judgments parse (A and B) and for a random one whose judgments do not; an
unparseable or timed-out judgment is the low score and counted; the judged recipe dry-runs and trains 2 steps."""
import json
from pathlib import Path

import pytest

import rewards

from data.factqa import factqa_row
from data.rows import write_rows
from data.verifier import convert_verifier
from grpo.judge import judgment_result
from grpo.scoring import Scorer
from launch.build import build_judge
from launch.dist import DistInfo
from launch.recipe import load_config
from models import load_tokenizer
from models.chat import prefix_decoder
from rewards.verifier import parse_judgment

RECIPE = Path(__file__).resolve().parents[1] / "launch" / "configs" / "judge_grpo.yaml"
# (question, reference, candidate, gold judgment)
ROWS = [("What is the capital of France?", "Paris", "Paris", "A"),
        ("Who wrote Hamlet?", "William Shakespeare", "Charles Dickens", "B"),
        ("What is 12 times 12?", "144", "144", "A"),
        ("Which planet is the largest in the Solar System?", "Jupiter", "Mars", "B"),
        ("What is the chemical symbol for gold?", "Au", "Au", "A"),
        ("In which year did World War II end?", "1945", "1918", "B")]
JUDGMENT_TOKENS = 12


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, tiny_model_dir):
    """(verifier rows file, the run directory of a tiny verifier SFT-trained on them until it judges them right)."""
    from launch.train import run
    root = tmp_path_factory.mktemp("judge")
    judgments = root / "judgments.jsonl"
    judgments.write_text("".join(json.dumps({"question": q, "gold_answer": r, "llm_response": c, "gold_judgment": g})
                                 + "\n" for q, r, c, g in ROWS))
    write_rows(convert_verifier(judgments), root / "verifier.jsonl")
    cfg = load_config(RECIPE.parent / "verifier_sft.yaml", [
        f"model.name_or_path={tiny_model_dir}", f"data.train_files=['{root / 'verifier.jsonl'}']",
        "data.eval_files=[]", "trainer.steps=40", "trainer.sft_batch_size=6", "trainer.micro_batch_size=6",
        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.schedule=constant", "model.param_dtype=float32",
        "model.gradient_checkpointing=false", "trainer.save_every=0", f"trainer.out_dir={root}",
        "trainer.run_name=verifier"])
    run(cfg, DistInfo())
    return root / "verifier.jsonl", root / "verifier"


def _judging_scorer(model) -> Scorer:
    """The Scorer a run with reward.model=`model` builds (its judge from launch.build)."""
    judge = build_judge(load_config(None, [f"reward.model={model}",
                                           f"reward.model_max_new_tokens={JUDGMENT_TOKENS}"]), DistInfo())
    return Scorer(rewards.compute_score, prefix_decoder(load_tokenizer(None)), judge=judge)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_judge_reward_equals_the_verifier_reward_of_its_offline_judgments(which, verifier, tiny_model_dir, tmp_path):
    from launch.eval import main
    rows_file, run_dir = verifier
    model = run_dir if which == "trained" else tiny_model_dir
    assert main(["--model", str(model), "--data", str(rows_file), "--out", str(tmp_path),
                 "--max-new-tokens", str(JUDGMENT_TOKENS)]) == 0
    offline = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    # The policy's rows and completions: the candidate is the <answer> block, the reference the ground truth.
    policy_rows = [factqa_row(q, [r], index=i, split="train", dataset="t") for i, (q, r, _, _) in enumerate(ROWS)]
    texts = [f"<think>I recall the fact here.</think> <answer> {c} </answer>" for _, _, c, _ in ROWS]
    scores = _judging_scorer(model).score(texts, [[1]] * len(texts), policy_rows)  # one generate call
    assert scores.texts["judgment"] == [p["completion"] for p in offline]  # the same prompts, the same judgments
    letters = [parse_judgment(p["completion"]) for p in offline]
    assert scores.rewards.tolist() == [float(letter == "A") for letter in letters]
    for reward, prediction, (*_, gold) in zip(scores.rewards.tolist(), offline, ROWS):
        if gold == "A":  # the verifier reward is agreement with the gold label: the judge reward where gold is A
            assert reward == prediction["reward"]
    assert scores.components["judge_unparsed"] == [float(letter is None) for letter in letters]
    assert scores.components["judge_timeout"] == [0.0] * len(ROWS)
    if which == "trained":  # parsed A and B judgments, each the gold label: the comparison above is not vacuous
        assert letters == [gold for *_, gold in ROWS] and scores.rewards.tolist() == [1.0, 0.0] * 3
    else:
        assert letters.count(None) >= 4 and sum(scores.components["judge_unparsed"]) == letters.count(None)


def test_unparseable_and_timed_out_judgments_score_low_and_are_counted(verifier):
    assert judgment_result("I cannot decide.", "stop") == {
        "score": 0.0, "correct": 0.0, "judge_unparsed": 1.0, "judge_timeout": 0.0, "judgment": "I cannot decide."}
    assert judgment_result("Final Judgment: \\boxed{A}", "timeout")["score"] == 0.0  # not finished in time
    assert judgment_result("Final Judgment: \\boxed{C}", "stop")["score"] == 0.0
    assert judgment_result("Final Judgment: \\boxed{A}", "length")["score"] == 1.0
    # A real timeout on the trained verifier: every judgment stopped after its first token, scored 0, counted.
    scorer = _judging_scorer(verifier[1])
    scorer.judge.timeout_s = 1e-9
    rows = [factqa_row("What is the capital of France?", ["Paris"], index=0, split="train", dataset="t")] * 3
    scores = scorer.score(["<answer>Paris</answer>"] * 3, [[1]] * 3, rows)
    assert scores.rewards.tolist() == [0.0] * 3 and scores.components["judge_timeout"] == [1.0] * 3
    assert scores.components["judge_unparsed"] == [0.0] * 3 and scores.texts["judgment"] == ["Final"] * 3
    scorer.judge.timeout_s = None
    assert scorer.score(["<answer>Paris</answer>"], [[1]], rows[:1]).rewards.tolist() == [1.0]


def test_the_judged_recipe_dry_runs_and_refuses_what_it_cannot_run(verifier, tiny_model_dir, tmp_path, capsys,
                                                                   monkeypatch):
    from launch.train import main
    assert main(["--config", str(RECIPE), "--dry-run", "--device", "cuda", "--world-size", "1"]) == 0
    rows = tmp_path / "factqa.jsonl"
    write_rows([factqa_row(q, [r], index=i, split="train", dataset="t") for i, (q, r, _, _) in enumerate(ROWS)], rows)
    local = [f"data.train_files=['{rows}']", f"data.eval_files=['{rows}']", f"reward.model={verifier[1]}",
             f"model.name_or_path={tiny_model_dir}"]
    assert main(["--config", str(RECIPE), "--dry-run", *local]) == 0
    for override, message in (("rollout.engine=vllm", "rollout.engine=hf (not vllm"),
                              ("reward.num_workers=1", "reward.num_workers=0 (not 1)"),
                              (f"reward.model={tmp_path / 'none'}", "reward.model: model path")):
        assert main(["--config", str(RECIPE), "--dry-run", *local, override]) == 2
        assert message in capsys.readouterr().err, override
    monkeypatch.chdir(tmp_path)  # the recipe's own checkpoint is missing: the message names its recipe
    assert main(["--config", str(RECIPE), "--dry-run", *local[:2], "reward.model=runs/verifier_dapo"]) == 2
    assert "(made by: python -m launch.train --config launch/configs/verifier_dapo.yaml" in capsys.readouterr().err


def test_a_judged_run_trains_two_steps_and_its_held_out_reward_is_the_judges(verifier, tiny_model_dir, tmp_path):
    from launch.eval import main
    from launch.train import run
    rows = tmp_path / "factqa.jsonl"
    write_rows([factqa_row(q, [r], index=i, split="train", dataset="t") for i, (q, r, _, _) in enumerate(ROWS)], rows)
    cfg = load_config(RECIPE, [f"model.name_or_path={tiny_model_dir}", f"data.train_files=['{rows}']",
                               f"data.eval_files=['{rows}']", f"reward.model={verifier[1]}",
                               f"reward.model_max_new_tokens={JUDGMENT_TOKENS}", "rollout.max_new_tokens=8",
                               "trainer.steps=2", "trainer.eval_every=1", "trainer.prompts_per_step=2",
                               f"trainer.out_dir={tmp_path}", "trainer.run_name=judged"])
    summary = run(cfg, DistInfo())
    run_dir = tmp_path / "judged"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2] and all(m["grad_norm"] == m["grad_norm"] for m in metrics[1:])
    for m in metrics[1:]:  # the judge's counts, logged every step
        assert {"reward/judge_unparsed", "reward/judge_timeout"} <= set(m) and m["reward/judge_timeout"] == 0.0
    assert "eval/judge_unparsed" in metrics[0] and "eval/judge_unparsed" in metrics[-1]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * cfg.rollout.n and all(s["judgment"].startswith("Final") for s in samples)
    # The held-out reward is the judge's: launch.eval --judge on the final checkpoint gives the same per row.
    assert main(["--model", str(run_dir), "--data", str(rows), "--out", str(tmp_path / "eval"),
                 "--max-new-tokens", "8", "--judge", str(verifier[1]),
                 "--judge-max-new-tokens", str(JUDGMENT_TOKENS)]) == 0
    offline = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [p["reward"] for p in offline] == summary["after"]["values"]["reward"]
    assert all(p["judgment"].startswith("Final") for p in offline)
