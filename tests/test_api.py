"""The Python entry point (launch.api.train): the README's example runs as written, a dict config with rewards
defined in code and rows in memory trains and reports held-out results, bad input is a ConfigError, and
Weights & Biases logging works offline."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rewards
from launch.api import train
from grpo.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# README example (tests/test_api.py runs this block)"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    [block] = [block for block in blocks if block.startswith(MARKER)]
    return block


def test_the_readme_example_runs_as_written(tmp_path):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 20  # a short example, not a script
    assert "/tmp/nanogrpo-example" in code
    code = code.replace("/tmp/nanogrpo-example", str(tmp_path / "out"))  # the run and its checkpoint go with the test
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    finished = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True,
                              text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]


def _example_script(tmp_path, guarded: bool) -> subprocess.CompletedProcess:
    """The README example with reward.num_workers=2 added, run as a script file (the reward workers' fork server
    imports a script's module again), with or without the `__main__` guard around its training call."""
    code = readme_example().replace("/tmp/nanogrpo-example", str(tmp_path / "out"))
    code = code.replace('"rollout.n=4",', '"rollout.n=4", "reward.num_workers=2",')
    assert "reward.num_workers=2" in code
    if guarded:
        head, call = code.split("result = train(")
        code = head + 'if __name__ == "__main__":\n    result = train(' + call.replace("\n", "\n    ").rstrip() + "\n"
    script = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    script.write_text(code)
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_example_with_reward_workers_needs_the_main_guard_and_runs_with_it(tmp_path):
    refused = _example_script(tmp_path, guarded=False)
    assert refused.returncode != 0 and not (tmp_path / "out").exists(), refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].endswith(
        'put its training call under `if __name__ == "__main__":` (or set reward.num_workers=0)'), refused.stderr[-2000:]
    finished = _example_script(tmp_path, guarded=True)  # the function defined in the script reaches the workers
    assert finished.returncode == 0, finished.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "num_workers: 2" in (tmp_path / "out" / "run" / "config.yaml").read_text()


def _rows(n, data_source="api_letters"):
    letters = "abcdefghijklmnop"
    return [{"prompt": [{"role": "user", "content": f"Say a word that starts with {letters[i]}."}],
             "data_source": data_source, "reward_model": {"ground_truth": letters[i]}, "extra_info": {"index": i}}
            for i in range(n)]


def starts_with(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip().lower().startswith(ground_truth))


def test_a_dict_config_rewards_in_code_and_rows_in_memory(tmp_path, tiny_model_dir):
    config = {"model": {"name_or_path": str(tiny_model_dir)}, "rollout": {"n": 4, "max_new_tokens": 6},
              "trainer": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "out_dir": str(tmp_path),
                          "run_name": "api"}}
    result = train(config, overrides=["optim.lr=1e-3"], rewards={"api_letters": starts_with},
                   train_rows=_rows(8), eval_rows=_rows(4))
    run_dir = Path(result["run_dir"])
    assert run_dir == tmp_path / "api" and (run_dir / "checkpoints" / "step_2").is_dir()
    assert result["before"]["count"] == result["after"]["count"] == 4 and "reward" in result["after"]["means"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    with pytest.raises(ConfigError, match=r"train_rows\[1\]"):  # a bad row is named before anything is written
        train(config, rewards=starts_with, train_rows=[_rows(1)[0], {"prompt": "not a chat"}])
    # The rewards were this run's only (on 5cd6fe9 the next call silently scored with them).
    assert "api_letters" not in rewards.registered()
    with pytest.raises(ConfigError, match="api_letters"):
        train({**config, "trainer": {**config["trainer"], "run_name": "api2"}}, train_rows=_rows(8))


def test_weights_and_biases_offline(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"model": {"name_or_path": str(tiny_model_dir)}, "rollout": {"n": 2, "max_new_tokens": 4},
              "trainer": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "out_dir": str(tmp_path),
                          "run_name": "wandb", "wandb_project": "nanogrpo-tests"}}
    train(config, rewards=starts_with, train_rows=_rows(4))
    [run] = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")  # the run's records, for `wandb sync`
    records = run.read_bytes()
    assert b"reward_mean" in records and b"nanogrpo-tests" in records
