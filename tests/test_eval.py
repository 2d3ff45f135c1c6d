"""launch.eval end to end on the tiny random model (every metric key present and in range, the compare
table), full marks when the completions are the gold targets, model resolution and bad inputs."""
import json
import shutil
from pathlib import Path

import pytest

from data.factqa import factqa_row
from data.rows import make_row, read_rows, write_rows
from data.synthetic import generate_rows
from data.verifier import convert_verifier
from launch import eval as launch_eval
from models import load_tokenizer, render_prompt
from rollout.engine import Completion

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"count", "truncation_rate", "completion_tokens_mean"}
EXPECTED_KEYS = {
    "scifact_evidence": COMMON | {"reward_mean", "answer_accuracy", "evidence_f1", "evidence_exact_precision",
                                  "evidence_exact_recall", "evidence_exact_f1", "prefix_label_accuracy",
                                  "format_rate", "unsupported_rate", "nei_rate", "no_label_rate"},
    # no corpus index in tests: the factqa reward (and so reward_mean) is left out, not scored as 0
    "factqa_corpus": COMMON | {"correct_rate", "incorrect_rate", "not_attempted_rate", "precision", "recall", "f1",
                               "format_rate"},
    "verifier": COMMON | {"reward_mean", "accuracy", "parse_rate", "judgment_tokens_mean", "domain_accuracy"},
}
QA_ANSWERS = {"What is the capital of France?": "<think>The capital of France is Paris.</think><answer>Paris</answer>",
              "Who wrote Hamlet?": "<think>Hamlet was written by Shakespeare.</think><answer>Shakespeare</answer>"}


@pytest.fixture
def data_files(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOGRPO_CORPUS_INDEX", raising=False)
    files = {name: tmp_path / f"{name}.jsonl" for name in ("synthetic", "qa", "verifier")}
    write_rows(generate_rows(6, seed=1, split="test"), files["synthetic"])
    write_rows([factqa_row(question, [answer], index=i, split="test", dataset="handmade")
                for i, (question, answer) in enumerate([("What is the capital of France?", "Paris"),
                                                        ("Who wrote Hamlet?", "William Shakespeare")])], files["qa"])
    write_rows(convert_verifier(ROOT / "data" / "fixtures" / "verifier_sample.jsonl")[:3], files["verifier"])
    return files


def check_ranges(metrics: dict) -> None:
    for source, values in metrics.items():
        assert set(values) == EXPECTED_KEYS[source], source
        for key, value in values.items():
            if key == "domain_accuracy":
                assert value and all(0 <= v <= 1 for v in value.values())
            elif key.endswith("_mean") and key != "reward_mean" or key == "count":
                assert value >= 0
            else:
                assert 0 <= value <= 1, (source, key, value)


def test_eval_cli_on_tiny_model_and_compare(tmp_path, tiny_model_dir, data_files, capsys):
    out = tmp_path / "eval_tiny"
    argv = ["--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "6", "--batch-size", "4"]
    for path in data_files.values():
        argv += ["--data", str(path)]
    assert launch_eval.main(argv) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["count"] == 11 and list(summary["metrics"]) == ["scifact_evidence", "factqa_corpus", "verifier"]
    check_ranges(summary["metrics"])
    assert summary["metrics"]["scifact_evidence"]["count"] == 6
    assert summary["metrics"]["verifier"]["judgment_tokens_mean"] <= 6
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 11
    assert [p["row"] for p in predictions] == [1, 2, 3, 4, 5, 6, 1, 2, 1, 2, 3]
    assert all(1 <= p["completion_tokens"] <= 6 and isinstance(p["completion"], str) for p in predictions)
    assert {"predicted_label", "evidence_matched"} <= set(predictions[0]) and "attempted" in predictions[6]
    assert "### verifier" in (out / "report.md").read_text()

    # A run directory resolves to its latest complete checkpoint (step_3 has no COMPLETE marker).
    run = tmp_path / "my_run"
    for step in (1, 3):
        shutil.copytree(tiny_model_dir, run / "checkpoints" / f"step_{step}")
    (run / "checkpoints" / "step_1" / "COMPLETE").write_text("{}")
    out_relaxed = tmp_path / "eval_run"
    assert launch_eval.main(["--model", str(run), "--data", str(data_files["synthetic"]), "--out", str(out_relaxed),
                             "--max-new-tokens", "4", "--limit", "2", "--relaxed"]) == 0
    relaxed = json.loads((out_relaxed / "metrics.json").read_text())
    assert relaxed["model_dir"].endswith("step_1") and relaxed["relaxed"] and relaxed["count"] == 2
    check_ranges(relaxed["metrics"])

    capsys.readouterr()
    table_path = tmp_path / "table.md"
    assert launch_eval.main(["compare", str(out), str(out_relaxed), "--out", str(table_path)]) == 0
    table = table_path.read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    scifact_table = table.split("### factqa_corpus")[0].strip().splitlines()
    assert scifact_table[2].startswith("| model | count | answer_accuracy | evidence_f1 | evidence_exact_precision |")
    assert scifact_table[4].startswith("| eval_tiny | 6 |")
    assert scifact_table[5].startswith("| eval_run (relaxed) | 2 |")
    assert "| eval_run" not in table.split("### factqa_corpus")[1]  # the relaxed run did not see factqa rows
    assert "domain_accuracy[math]" in table


class TargetEngine:
    """A stand-in engine whose greedy completion of each prompt is a given text."""
    max_context = 4096

    def __init__(self, tokenizer, texts_by_prompt):
        self.tokenizer, self.texts_by_prompt = tokenizer, texts_by_prompt

    def generate(self, prompts, *, n, max_new_tokens, temperature, top_p, top_k, stop, seed):
        assert n == 1 and temperature == 0.0  # evaluation is greedy
        completions = []
        for prompt in prompts:
            text = self.texts_by_prompt[tuple(prompt)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            completions.append(Completion(list(prompt), ids, text, [0.0] * len(ids), "stop"))
        return completions


def test_gold_completions_get_full_marks(data_files):
    tokenizer = load_tokenizer(None)
    records = launch_eval.read_data([str(path) for path in data_files.values()], limit=None)
    texts = {}
    for path in data_files.values():
        for row in read_rows(path):
            text = row["extra_info"].get("target") or QA_ANSWERS[row["prompt"][-1]["content"]]
            texts[tuple(render_prompt(tokenizer, row["prompt"]))] = text
    predictions, metrics = launch_eval.evaluate_records(TargetEngine(tokenizer, texts), tokenizer, records,
                                                        max_new_tokens=64, batch_size=5)
    scifact = metrics["scifact_evidence"]
    assert scifact["answer_accuracy"] == scifact["evidence_f1"] == scifact["format_rate"] == 1.0
    assert scifact["evidence_exact_f1"] == scifact["prefix_label_accuracy"] == 1.0
    assert scifact["reward_mean"] == pytest.approx(1.0) and scifact["unsupported_rate"] == 0.0
    assert scifact["nei_rate"] == pytest.approx(2 / 6)  # generate_rows balances the three labels
    assert metrics["factqa_corpus"]["correct_rate"] == metrics["factqa_corpus"]["f1"] == 1.0
    assert metrics["factqa_corpus"]["format_rate"] == 1.0
    verifier = metrics["verifier"]
    assert verifier["accuracy"] == verifier["reward_mean"] == 1.0 and verifier["domain_accuracy"] == {"math": 1.0}
    assert [p["completion"] for p in predictions] == [texts[tuple(render_prompt(tokenizer, r["messages"]))]
                                                      for r in records]


def test_bad_inputs_fail_naming_the_path(tmp_path, tiny_model_dir, data_files, capsys):
    out = tmp_path / "out"

    def error(*argv):
        assert launch_eval.main(list(argv)) == 2
        return capsys.readouterr().err

    missing = tmp_path / "missing.jsonl"
    assert str(missing) in error("--model", str(tiny_model_dir), "--data", str(missing), "--out", str(out))
    nowhere = tmp_path / "nowhere"
    assert str(nowhere) in error("--model", str(nowhere), "--data", str(missing), "--out", str(out))
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    message = error("--model", str(tmp_path / "empty_run"), "--data", str(data_files["qa"]), "--out", str(out))
    assert "empty_run" in message and "complete checkpoint" in message
    bad = tmp_path / "bad.jsonl"
    rows = generate_rows(2, seed=0)
    rows.append(make_row([{"role": "user", "content": "?"}], data_source="scifact_evidence", ability="x",
                         ground_truth='{"answer": "MAYBE"}', index=2, split="test"))
    write_rows(rows, bad)
    message = error("--model", str(tiny_model_dir), "--data", str(bad), "--out", str(out))
    assert f"{bad} row 3" in message and "MAYBE" in message
    assert not out.exists()  # nothing is written when the inputs are bad
    assert str(tmp_path / "metrics.json") in error("compare", str(tmp_path))
