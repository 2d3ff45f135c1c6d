"""`make demo`'s driver end to end at toy size (a tiny random model, a few rows and steps): the three arms run,
the table gives every mean its interval and every arm its paired change, and the curves figure is written."""
import json

from launch.demo import main


def test_demo_runs_three_arms_and_writes_table_and_curves(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "demo"
    assert main(["--out", str(out), "--train-rows", "12", "--heldout-rows", "4", "--heldout-seed", "7",
                 f"model.name_or_path={tiny_model_dir}", "trainer.steps=2", "trainer.prompts_per_step=2",
                 "trainer.sft_batch_size=4", "trainer.micro_batch_size=8", "rollout.max_new_tokens=6",
                 "trainer.eval_every=1"]) == 0
    printed = capsys.readouterr().out
    table = (out / "summary.md").read_text()
    assert "Held-out prompts: 4" in table and table == printed.split("\n\n", 1)[1].split("\n\nCurves:")[0] + "\n"
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| base model", "| GRPO from base (2 steps)", "| SFT (2 steps)",
                                                      "| SFT + GRPO (2 steps)"]
    assert rows[0].count("[") == 4 and rows[3].count(" vs SFT") == 2 and rows[1].count(" vs base") == 2
    assert str(out / "curves.png") in printed and (out / "curves.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sft", "base_grpo", "grpo"} and summary["sft"]["before"]["count"] == 4
    # Every arm logged held-out points: step 0 (the SFT arm; the others start from a known result) and each step.
    sft_steps = [json.loads(line)["step"] for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()
                 if "eval/reward" in json.loads(line)]
    assert sft_steps == [0, 1, 2]
    # The held-out rows came from their own seed, not the training rows' seed 0.
    assert json.loads((out / "data" / "heldout.jsonl").read_text().splitlines()[0])["extra_info"]["generator_seed"] == 7


def test_the_tool_demo_runs_sft_then_grpo_with_the_calculator(tmp_path, tiny_model_dir, capsys):
    """`launch.demo --task tools` at toy size: the arithmetic rows, the SFT and GRPO arms with the calculator, the
    table with the paired change of each arm (no GRPO-from-base arm: the base model never calls the tool)."""
    out = tmp_path / "tools"
    assert main(["--task", "tools", "--out", str(out), "--train-rows", "8", "--heldout-rows", "4",
                 f"model.name_or_path={tiny_model_dir}", "trainer.steps=1", "trainer.prompts_per_step=2",
                 "trainer.sft_batch_size=4", "trainer.micro_batch_size=8", "rollout.max_new_tokens=24"]) == 0
    table = (out / "summary.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| base model", "| SFT (1 steps)", "| SFT + GRPO (1 steps)"]
    assert rows[2].count(" vs SFT") == 2 and table in capsys.readouterr().out
    assert json.loads((out / "data" / "train.jsonl").read_text().splitlines()[0])["data_source"] == "arithmetic"
    assert (out / "grpo" / "checkpoints" / "step_1" / "COMPLETE").exists()
