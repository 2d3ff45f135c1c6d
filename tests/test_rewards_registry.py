"""The reward registry: names, the decorator, dotted and file paths, unknown names, result checks."""
import pytest

import rewards
from rewards import compute_score, get_reward, register, registered
from rewards.scifact import evidence_qa_reward, scifact_evidence_reward

SHIPPED = {"scifact_evidence", "evidence_qa", "verifier", "factqa_corpus"}


@pytest.fixture
def clean_registry():
    saved = dict(rewards._REGISTRY)
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


def test_shipped_names():
    assert SHIPPED <= set(registered())
    assert get_reward("scifact_evidence") is scifact_evidence_reward


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError) as error:
        compute_score("no_such_reward", "x", "y")
    for name in SHIPPED:
        assert name in str(error.value)


def test_register_call_and_decorator(clean_registry):
    def constant(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    assert register("constant_test", constant) is constant
    assert register("constant_test", constant) is constant  # the same function again is fine
    assert compute_score("constant_test", "", "") == 0.5

    @register("decorated_test")
    def decorated(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1, "seen": extra_info["index"]}

    assert compute_score("decorated_test", "", "", {"index": 7}) == {"score": 1, "seen": 7}
    with pytest.raises(ValueError, match="already registered"):
        register("constant_test", decorated)
    register("constant_test", decorated, overwrite=True)
    assert get_reward("constant_test") is decorated
    with pytest.raises(ValueError, match="callable"):
        register("bad_test", "not a function")
    with pytest.raises(ValueError, match="non-empty"):
        register("", constant)


def test_dotted_and_file_paths(clean_registry, tmp_path):
    assert get_reward("rewards.scifact.evidence_qa_reward") is evidence_qa_reward
    assert get_reward("rewards.scifact:scifact_evidence_reward") is scifact_evidence_reward
    module = tmp_path / "my_reward.py"
    module.write_text("def reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str == ground_truth)\n")
    assert compute_score(f"{module}:reward", "42", "42") == 1.0
    for bad in ("rewards.scifact.no_such_function", "no_such_package.module.fn", f"{tmp_path}/absent.py:fn",
                "rewards.scifact:"):
        with pytest.raises(ValueError, match="registered data sources"):
            get_reward(bad)


@pytest.mark.parametrize("result, message", [
    (float("nan"), "finite"), ("0.5", "finite"), ({"value": 1.0}, "finite"),
    ({"score": 1.0, "sentences": [(0, 99, 0.1)]}, "outside"), ({"score": 1.0, "sentences": [(-1, 0, 0.1)]}, "outside"),
])
def test_bad_results_raise(clean_registry, result, message):
    register("bad_result_test", lambda data_source, solution_str, ground_truth, extra_info=None: result)
    with pytest.raises(ValueError, match=message):
        compute_score("bad_result_test", "short", "")


def test_numbers_become_floats(clean_registry):
    register("int_test", lambda data_source, solution_str, ground_truth, extra_info=None: 1)
    register("bool_test", lambda data_source, solution_str, ground_truth, extra_info=None: True)
    assert compute_score("int_test", "", "") == 1.0 and isinstance(compute_score("int_test", "", ""), float)
    assert compute_score("bool_test", "", "") == 1.0


def test_solution_must_be_a_string():
    with pytest.raises(TypeError, match="solution_str"):
        compute_score("verifier", None, "A")


def test_rewards_import_no_torch_or_tokenizer_library(tmp_path):
    import subprocess
    import sys

    # import every reward module, build and query a corpus index, then look at what got imported
    code = (
        "import json, sys, pathlib, rewards, rewards.corpus, rewards.triples\n"
        f"root = pathlib.Path({str(tmp_path)!r})\n"
        "(root / 'c.jsonl').write_text(json.dumps({'text': 'Paris is in France.'}) + '\\n')\n"
        "index = rewards.corpus.CorpusIndex(rewards.corpus.build_index(root / 'c.jsonl', root / 'index'))\n"
        "assert index.count_cooccurrence(['Paris'], ['France']) == 1\n"
        "bad = [name for name in ('torch', 'transformers', 'tokenizers') if name in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
