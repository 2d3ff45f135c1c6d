"""Factual QA rows and the self-filter (with a fake model and judge: the filter's logic, not a model's skill)."""
import json

import pytest

from data import factqa
from data.rows import read_rows
from launch import self_filter as self_filter_module
from launch.self_filter import load_judge

SHARED_COUNTS = {
    "nq_open_validation.json": 3610,
    "popqa_test.json": 14267,
    "simpleqa.json": 4326,
    "truthfulqa.json": 817,
    "stepwise_curriculum_llama31_8b.json": 4861,
}


def test_shared_files_row_counts(shared_data):
    for name, count in SHARED_COUNTS.items():
        rows = factqa.convert_factqa(shared_data / "factqa" / name)
        assert len(rows) == count, name
    first = factqa.convert_factqa(shared_data / "factqa" / "nq_open_validation.json")[0]
    assert first["reward_model"]["ground_truth"] == "14 December 1972 UTC;December 1972"
    assert first["prompt"] == [
        {"role": "system", "content": factqa.SYSTEM_PROMPT},
        {"role": "user", "content": "when was the last time anyone was on the moon"},
    ]
    assert first["data_source"] == "factqa_corpus" and first["extra_info"]["dataset"] == "nq_open"


def test_alias_and_curriculum_formats(tmp_path):
    aliases = tmp_path / "qa.json"
    aliases.write_text(json.dumps([
        {"question": "Who wrote  it?", "answer": "Bob Scott", "aliases": ["Bob Scott", " Bob Russell ", "", "A; B"]},
    ]))
    curriculum = tmp_path / "curr.jsonl"
    curriculum.write_text(json.dumps({"question": "When?", "answers": "2016;2016 ;", "title": "Andy Murray;List of X"}) + "\n")
    (row,) = factqa.convert_factqa(aliases, split="dev")
    # The answer leads; blanks and repeats go; ";" inside an alias becomes "," because ";" separates aliases.
    assert row["reward_model"]["ground_truth"] == "Bob Scott;Bob Russell;A, B"
    assert row["prompt"][1]["content"] == "Who wrote it?"
    assert row["extra_info"] == {"index": 0, "split": "dev", "dataset": "qa", "answer": "Bob Scott"}
    (row,) = factqa.convert_factqa(curriculum, start_index=5)
    assert row["reward_model"]["ground_truth"] == "2016"
    assert row["extra_info"]["titles"] == ["Andy Murray", "List of X"] and row["extra_info"]["index"] == 5


@pytest.mark.parametrize(
    "record, message",
    [
        ({"answer": "x", "aliases": ["x"]}, "qa.json element 2: missing field 'question'"),
        ({"question": "q?"}, "qa.json element 2: missing field 'aliases'"),
        ({"question": "q?", "answer": "x", "aliases": "x"}, "qa.json element 2: field 'aliases' must be list"),
        ({"question": "q?", "answer": "", "aliases": [" "]}, "qa.json element 2: no non-empty answer alias"),
        ({"question": " ", "answers": "x"}, "qa.json element 2: field 'question' is empty"),
    ],
)
def test_bad_records_name_the_element(tmp_path, record, message):
    path = tmp_path / "qa.json"
    path.write_text("[\n" + json.dumps({"question": "ok?", "answer": "a", "aliases": []}) + ",\n" + json.dumps(record) + "\n]")
    with pytest.raises(ValueError, match=message):
        factqa.convert_factqa(path)


def test_convert_cli(tmp_path, shared_data, capsys):
    out = tmp_path / "fq.parquet"
    inputs = [str(shared_data / "factqa" / name) for name in ("truthfulqa.json", "simpleqa.json")]
    factqa.main(["convert", "--input", *inputs, "--out", str(out), "--limit", "10"])
    rows = read_rows(out)
    assert [row["extra_info"]["index"] for row in rows] == list(range(20))
    assert [row["extra_info"]["dataset"] for row in rows] == ["truthfulqa"] * 10 + ["simpleqa"] * 10


def make_rows(answers):
    return [factqa.factqa_row(f"question {i}?", [answer], index=i, split="train", dataset="toy") for i, answer in enumerate(answers)]


def question_of(messages):
    """The last user message: the prompt the fake model below reads."""
    return [message["content"] for message in messages if message["role"] == "user"][-1]


def self_filter(rows, generate_fn, judge_fn, **settings):
    """launch.self_filter.self_filter with the question text as each prompt."""
    return self_filter_module.self_filter(rows, generate_fn, judge_fn, render=question_of, **settings)


def fake_generate(right_counts, calls):
    """A stand-in model: for 'question i?' it answers right in the first right_counts[i] of its n samples."""
    def generate(prompts, n):
        calls.append((list(prompts), n))
        out = []
        for prompt in prompts:
            i = int(prompt.split()[1].rstrip("?"))
            out.append([f"<think>x</think><answer>{'right' if k < right_counts[i] else 'wrong'}</answer>" for k in range(n)])
        return out
    return generate


def judge(text, ground_truth):
    return "<answer>right</answer>" in text and ground_truth == "right"


def test_self_filter_keeps_the_learning_zone():
    right_counts = [0, 1, 2, 3, 4, 4, 0, 3]
    calls = []
    rows = make_rows(["right"] * len(right_counts))
    kept, stats = self_filter(rows, fake_generate(right_counts, calls), judge, group_size=4, batch_size=3)
    # Default zone 1..G-1 = 1..3: questions 1, 2, 3, 7.
    assert [row["extra_info"]["index"] for row in kept] == [1, 2, 3, 7]
    assert [row["extra_info"]["self_filter"]["correct"] for row in kept] == [1, 2, 3, 3]
    assert stats["correct_histogram"] == [2, 1, 1, 2, 2] and stats["kept"] == 4 and stats["anchors"] == 0
    assert [len(prompts) for prompts, _ in calls] == [3, 3, 2] and all(n == 4 for _, n in calls)
    assert calls[0][0][0] == "question 0?"  # the prompt text is the question
    assert "self_filter" not in rows[1]["extra_info"]  # the input rows are not modified

    kept, _ = self_filter(rows, fake_generate(right_counts, []), judge, group_size=4, min_correct=2, max_correct=4)
    assert [row["extra_info"]["index"] for row in kept] == [2, 3, 4, 5, 7]


def test_anchors_are_always_correct_and_seeded():
    right_counts = [4, 1, 4, 4, 2, 4, 0, 4]
    rows = make_rows(["right"] * len(right_counts))
    kept, stats = self_filter(rows, fake_generate(right_counts, []), judge, group_size=4, anchors=2, seed=3)
    anchors = [row["extra_info"]["index"] for row in kept if row["extra_info"]["self_filter"]["anchor"]]
    assert len(anchors) == 2 and all(right_counts[i] == 4 for i in anchors) and stats["anchors"] == 2
    again, _ = self_filter(rows, fake_generate(right_counts, []), judge, group_size=4, anchors=2, seed=3)
    assert again == kept
    everything, stats = self_filter(rows, fake_generate(right_counts, []), judge, group_size=4, anchors=99)
    assert stats["anchors"] == 5 and stats["kept"] == 7  # all five always-right rows, plus rows 1 and 4


def test_self_filter_rejects_bad_settings_and_bad_generate_output():
    rows = make_rows(["right", "right"])
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        self_filter(rows, fake_generate([0, 0], []), judge, group_size=1)
    with pytest.raises(ValueError, match="min_correct <= max_correct"):
        self_filter(rows, fake_generate([0, 0], []), judge, group_size=4, min_correct=3, max_correct=2)
    with pytest.raises(ValueError, match=r"returned \[2\] completions for the 2 prompts from row 0; expected 2 each"):
        self_filter(rows, lambda prompts, n: [["a"] * n], judge, group_size=2)
    with pytest.raises(ValueError, match=r"returned \[3, 3\] completions for the 2 prompts from row 0; expected 2"):
        self_filter(rows, lambda prompts, n: [["a"] * 3 for _ in prompts], judge, group_size=2)


def test_load_judge_and_question_of():
    exact = load_judge("operator:eq")  # any importable (text, ground_truth) -> bool callable
    assert exact("Paris", "Paris") is True and exact("Lyon", "Paris") is False
    numeric = load_judge("operator:sub")  # a reward-style judge: numbers count as correct when > 0
    assert numeric(3, 1) is True and numeric(1, 3) is False
    with pytest.raises(ValueError, match="'' must look like module:function"):
        load_judge("")
    with pytest.raises(ValueError, match="must look like module:function"):
        load_judge("rewards")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_judge("data.no_such_module:judge")
    with pytest.raises(ValueError, match="returned str; expected bool or a number"):
        load_judge("operator:add")("a", "b")
    assert question_of([{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]) == "q?"


def test_filter_cli_runs_the_engine_end_to_end(tmp_path, tiny_model_dir, capsys):
    # A random tiny model cannot answer; this checks the wiring: chat rendering, engine sampling, judging, writing.
    rows = [factqa.factqa_row(f"Question {i}?", ["e"], index=i, split="train", dataset="toy") for i in range(3)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    from data.rows import write_rows

    write_rows(rows, source)
    from launch.self_filter import main as self_filter_main
    self_filter_main(["--input", str(source), "--out", str(out), "--model", str(tiny_model_dir),
                 "--group-size", "2", "--min-correct", "0", "--max-correct", "2", "--max-new-tokens", "6",
                 "--batch-size", "2", "--judge", "operator:contains"])  # correct when "e" occurs in the text
    kept = read_rows(out)
    assert [row["extra_info"]["index"] for row in kept] == [0, 1, 2]
    assert all(row["extra_info"]["self_filter"]["samples"] == 2 for row in kept)
    assert "kept 3 of 3 rows" in capsys.readouterr().out
    # The default judge is the reward's string-match judge: random text has no <answer> block, so it is never
    # right, no question lands in the 1..G-1 zone, and nothing is written.
    with pytest.raises(SystemExit, match="no question was answered correctly between 1 and 1 times"):
        self_filter_main(["--input", str(source), "--out", str(tmp_path / "none.jsonl"),
                     "--model", str(tiny_model_dir), "--group-size", "2", "--max-new-tokens", "4"])
    assert not (tmp_path / "none.jsonl").exists()


def test_every_gold_answer_passes_the_reward_judge(shared_data):
    from rewards.factqa import judge as reward_judge

    for name in SHARED_COUNTS:
        for row in factqa.convert_factqa(shared_data / "factqa" / name)[:200]:
            completion = f"<think>I recall the fact.</think><answer>{row['extra_info']['answer']}</answer>"
            assert reward_judge(completion, row["reward_model"]["ground_truth"]) == 2.0, row["extra_info"]
