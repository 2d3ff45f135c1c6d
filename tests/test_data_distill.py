"""Verifier distillation: launch.distill's filters pinned on scripted teacher outputs (one per reason), the report's
counts, the SFT rows it writes, and launch.distill end to end (a scripted engine through the real tokenizer, and
the embedded SmolLM2-135M as the teacher)."""
import json
from pathlib import Path

import pytest

from data.rows import read_rows
from data.verifier import convert_verifier
from launch import distill as launch_distill
from launch.distill import REASONS, DistillReport, distill_example, judge_sample, split_reasoning, write_distilled
from rewards.verifier import verifier_reward
from rollout.engine import Completion

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "data" / "fixtures" / "verifier_sample.jsonl"
BOX_A, BOX_B = "Final Judgment: \\boxed{A}", "Final Judgment: \\boxed{B}"


def words(text: str) -> int:
    return len(text.split())


def judge(text: str, gold: str = "A", finish_reason: str = "stop", max_tokens: int = 10):
    return judge_sample(text, gold, finish_reason=finish_reason, max_reasoning_tokens=max_tokens, count_tokens=words)


@pytest.mark.parametrize("text, gold, finish_reason, reason, reasoning", [
    (f"Both say 144.\n\n{BOX_A}", "A", "stop", "kept", "Both say 144."),
    # a thinking teacher: only the summary after </think> counts (the box inside the thinking is ignored)
    ("<think>Maybe \\boxed{B}? Long thoughts.</think>\nBoth say 144.\n" + BOX_A, "A", "stop", "kept", "Both say 144."),
    ("Both say 144.\n\n**Final Judgment:** \\boxed{A}.", "A", "stop", "kept", "Both say 144."),
    ("It says 8, not 9. Final Judgment: $\\boxed{B}$", "B", "stop", "kept", "It says 8, not 9."),
    (f"Both say 144.\n\n{BOX_A}", "A", "length", "truncated", None),
    ("<think>Still weighing the two answers", "A", "stop", "unfinished_thinking", None),
    ("They look the same to me.", "A", "stop", "no_judgment", None),
    ("Hmm.\nFinal Judgment: \\boxed{D}", "A", "stop", "label_outside_set", None),
    (f"They differ.\n{BOX_B}", "A", "stop", "wrong_judgment", None),
    (f"It is wrong.\n{BOX_B}", "C", "stop", "wrong_judgment", None),  # B and C are distinct here
    (f"First \\boxed{{B}}, on reflection: {BOX_A}", "A", "stop", "unstructured", None),  # two boxes
    (f"Final Judgment: A. So, {BOX_A}", "A", "stop", "unstructured", None),  # the judgment stated twice
    (f"Same.\n{BOX_A}\nAlso, let me add more.", "A", "stop", "unstructured", None),  # text after the box
    ("They match.\nFinal Judgment: A", "A", "stop", "unstructured", None),  # a bare letter, no box
    ("They match. [Correct]", "A", "stop", "unstructured", None),  # an xVerify tag only
    ("The answer is \\boxed{A}", "A", "stop", "unstructured", None),  # a box without the marker
    (f"**  {BOX_A}", "A", "stop", "empty_reasoning", None),
    ("one two three four five six seven eight nine ten.\n" + BOX_A, "A", "stop", "kept",
     "one two three four five six seven eight nine ten."),  # 10 words: at the limit
    ("one two three four five six seven eight nine ten eleven.\n" + BOX_A, "A", "stop", "overlong", None),
])
def test_filter_on_scripted_teacher_outputs(text, gold, finish_reason, reason, reasoning):
    verdict = judge(text, gold, finish_reason)
    assert verdict.reason == reason
    if reason == "kept":
        assert verdict.reasoning == reasoning and verdict.judgment == gold


def test_split_reasoning_needs_one_final_line():
    assert split_reasoning("x\nFinal Judgment: \\boxed{A}") == "x"
    assert split_reasoning("x\nFinal Judgment: \\boxed{A} y") is None
    assert split_reasoning("Final Judgment: \\boxed{A}") == ""


def test_bad_gold_is_refused():
    with pytest.raises(ValueError, match="gold judgment"):
        judge(BOX_A, gold="D")


def verifier_rows(limit: int) -> list[dict]:
    return convert_verifier(FIXTURE)[:limit]


def test_report_counts_every_sample_once_and_rows_pass_the_filter(tmp_path):
    rows = verifier_rows(3)  # gold A, B, A
    samples = [
        [(f"Both say 144.\n{BOX_A}", "stop"), (f"Both say 144.\n{BOX_A}", "stop"),  # kept, duplicate
         (f"12 times 12 is 144.\n{BOX_A}", "stop"), ("no idea", "stop")],  # surplus, no_judgment
        [(f"They agree.\n{BOX_A}", "stop"), (f"8 is not 9.\n{BOX_B}", "stop"),  # wrong, kept
         ("<think>hmm", "stop"), ("x", "length")],  # unfinished_thinking, truncated
        [("a b c d e f g h i j k l.\n" + BOX_A, "stop"), (f"Same.\n{BOX_B}", "stop"),  # overlong, wrong
         (f"{BOX_A}", "stop"), ("Hmm \\boxed{E}", "stop")],  # empty_reasoning, label_outside_set
    ]
    report = DistillReport(samples_per_example=4)
    kept = []
    for row, row_samples in zip(rows, samples):
        kept += distill_example(row, row_samples, report, per_example=1, max_reasoning_tokens=10, count_tokens=words,
                                teacher="scripted")
    summary = report.as_dict()
    assert summary["by_reason"] == {"kept": 2, "truncated": 1, "unfinished_thinking": 1, "no_judgment": 1,
                                    "label_outside_set": 1, "wrong_judgment": 2, "unstructured": 0,
                                    "empty_reasoning": 1, "overlong": 1, "duplicate": 1, "surplus": 1}
    assert summary["samples"] == sum(summary["by_reason"].values()) == 3 * 4
    assert (summary["examples"], summary["examples_with_kept"], summary["kept_by_label"]) == (3, 2, {"A": 1, "B": 1,
                                                                                                     "C": 0})
    out = tmp_path / "sft.jsonl"
    assert write_distilled(kept, out, report) == tmp_path / "sft.report.json"
    assert json.loads((tmp_path / "sft.report.json").read_text()) == summary
    written = read_rows(out)
    assert [row["extra_info"]["target"] for row in written] == [f"Both say 144.\n\n{BOX_A}", f"8 is not 9.\n\n{BOX_B}"]
    assert [(row["extra_info"]["index"], row["extra_info"]["source_index"]) for row in written] == [(0, 0), (1, 1)]
    for row in written:  # what was written passes the filter again and earns the verifier reward
        target, gold = row["extra_info"]["target"], row["reward_model"]["ground_truth"]
        assert judge(target, gold).reason == "kept"
        assert verifier_reward("verifier", target, gold)["score"] == 1.0
        assert row["prompt"] == rows[row["extra_info"]["source_index"]]["prompt"]


def test_nothing_kept_writes_the_report_only(tmp_path):
    report = DistillReport(samples_per_example=1)
    distill_example(verifier_rows(1)[0], [("no idea", "stop")], report, per_example=1, max_reasoning_tokens=10,
                    count_tokens=words, teacher="scripted")
    with pytest.raises(ValueError, match="no teacher sample passed"):
        write_distilled([], tmp_path / "sft.jsonl", report)
    assert not (tmp_path / "sft.jsonl").exists() and (tmp_path / "sft.report.json").exists()


class ScriptedEngine:
    """Returns the scripted teacher texts in order, `n` per prompt (the model is replaced, the tokenizer is real)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, list(texts)

    def generate(self, prompts, *, n, max_new_tokens, temperature, top_p, top_k, stop, seed):
        completions = []
        for prompt in prompts:
            for _ in range(n):
                text = self.texts.pop(0)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                completions.append(Completion(list(prompt), ids, text, [0.0] * len(ids), "stop"))
        return completions


def test_distill_rows_through_the_chat_template_with_a_scripted_teacher():
    from models import load_tokenizer

    tokenizer = load_tokenizer(None)
    rows = verifier_rows(2)  # gold A, B
    texts = [f"<think>long</think>The numbers agree.\n{BOX_A}", "junk", "junk", f"8 is not 9.\n{BOX_B}"]
    kept, report = launch_distill.distill_rows(
        ScriptedEngine(tokenizer, texts), tokenizer, rows, samples=2, max_reasoning_tokens=64, per_example=1,
        max_new_tokens=32, temperature=0.7, top_p=1.0, batch_size=1, seed=0, teacher="scripted")
    assert [row["extra_info"]["target"] for row in kept] == [f"The numbers agree.\n\n{BOX_A}",
                                                             f"8 is not 9.\n\n{BOX_B}"]
    assert report.counts["kept"] == 2 and report.counts["no_judgment"] == 2


def test_cli_refuses_bad_input_before_loading_a_model(tmp_path, capsys):
    bad = tmp_path / "judgments.jsonl"
    bad.write_text('{"question": "q", "gold_answer": "a", "llm_response": "r", "gold_judgment": "maybe"}\n')
    assert launch_distill.main(["--teacher", "default", "--input", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{bad}:1: field 'gold_judgment' is 'maybe'" in capsys.readouterr().err
    assert launch_distill.main(["--teacher", "default", "--input", str(FIXTURE), "--out", str(tmp_path / "o.jsonl"),
                                "--samples", "0"]) == 2
    assert "--samples must be at least 1" in capsys.readouterr().err


def test_cli_end_to_end_on_the_embedded_model(tmp_path):
    # A 135M teacher rarely writes a correct, well-formed judgment: this checks the pipeline and the report,
    # not quality. Two examples (after the 1:1 rebalance of the first three rows) x 2 samples x 24 tokens.
    out = tmp_path / "sft.jsonl"
    status = launch_distill.main(["--teacher", "default", "--input", str(FIXTURE), "--out", str(out), "--limit", "3",
                                  "--samples", "2", "--max-new-tokens", "24", "--max-reasoning-tokens", "64"])
    report = json.loads((tmp_path / "sft.report.json").read_text())
    assert report["examples"] == 2 and report["samples"] == 4 == sum(report["by_reason"].values())
    assert set(report["by_reason"]) == set(REASONS)
    assert status == (0 if report["kept"] else 1) and out.exists() == bool(report["kept"])
    for row in read_rows(out) if out.exists() else []:
        target, gold = row["extra_info"]["target"], row["reward_model"]["ground_truth"]
        assert judge(target, gold, max_tokens=10**6).reason == "kept"


def test_verifier_sft_recipe_trains_on_distilled_rows_with_the_embedded_model(tmp_path):
    # SFT -> DAPO from shipped recipes: the distilled rows feed verifier_sft.yaml (one step here, on the
    # embedded SmolLM2-135M); verifier_dapo.yaml's init_from is that run's final checkpoint (test_recipes runs it).
    from launch.recipe import load_config
    from launch.dist import DistInfo
    from launch.train import run
    from models import load_tokenizer

    tokenizer = load_tokenizer(None)
    texts = [f"Both are 144.\n{BOX_A}", f"8 is not 9.\n{BOX_B}"]
    kept, report = launch_distill.distill_rows(
        ScriptedEngine(tokenizer, texts), tokenizer, verifier_rows(2), samples=1, max_reasoning_tokens=64,
        per_example=1, max_new_tokens=32, temperature=0.7, top_p=1.0, batch_size=2, seed=0, teacher="scripted")
    rows = tmp_path / "sft.jsonl"
    write_distilled(kept, rows, report)
    recipe = ROOT / "launch" / "configs" / "verifier_sft.yaml"
    cfg = load_config(recipe, ["model.name_or_path=null", "model.param_dtype=float32", f"data.train_files=['{rows}']",
                               "data.eval_files=[]", "trainer.steps=1", "trainer.sft_batch_size=2",
                               "trainer.micro_batch_size=2", "trainer.save_every=0", f"trainer.out_dir={tmp_path}",
                               "trainer.run_name=sft"])
    run(cfg, DistInfo())
    metrics = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["loss"] > 0
    assert (tmp_path / "sft" / "checkpoints" / "step_1" / "COMPLETE").exists()
    shipped_sft, dapo = load_config(recipe), load_config(ROOT / "launch" / "configs" / "verifier_dapo.yaml")
    assert dapo.init_from == f"runs/{shipped_sft.trainer.run_name}/checkpoints/step_{shipped_sft.trainer.steps}"
