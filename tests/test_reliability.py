"""Failures: kill -9 during a step and during a checkpoint save (one process and 2-rank torchrun), and Ctrl-C,
then resume to the same metrics as an uninterrupted run; flat rewards; injected non-finite losses."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import free_port

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("time_", "tokens_per_s", "sync/")


def _rows(path: Path) -> Path:
    from data.rows import write_rows
    write_rows([{"prompt": [{"role": "user", "content": f"Tell me about {i}."}], "data_source": "tests_vowels",
                 "reward_model": {"ground_truth": "{}"}, "extra_info": {"index": i}} for i in range(8)], path)
    return path


def _command(tmp_path, model_dir, run_name, *, ranks=1, steps=4, extra=(), launcher=None):
    launcher = launcher or [sys.executable, "-m", "launch.train"] if ranks == 1 else [
        str(Path(sys.executable).with_name("torchrun")), f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "launch.train"]
    return launcher + [
        f"model.name_or_path={model_dir}", f"data.train_files=['{_rows(tmp_path / 'rows.jsonl')}']",
        "reward.functions={tests_vowels: 'rewards_for_tests:vowel_fraction'}", "rollout.n=4",
        "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
        f"trainer.steps={steps}", "trainer.save_every=2", "optim.lr=1e-3", f"trainer.out_dir={tmp_path}",
        f"trainer.run_name={run_name}", *extra]


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def _run(command, env=None):
    finished = subprocess.run(command, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=400)
    assert finished.returncode == 0, f"{finished.stdout[-2000:]}\n{finished.stderr[-5000:]}"
    return finished


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in metrics]


def _kill_when(command, ready, env=None, timeout=300):
    """Start `command` in its own process group and SIGKILL the whole group once ready() is true."""
    process = subprocess.Popen(command, cwd=ROOT, env=env or _env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while not ready():
        assert process.poll() is None, "the run finished before it could be killed"
        assert time.time() < deadline, "timed out waiting to kill the run"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, tiny_model_dir):
    """Uninterrupted runs (1 process and 2 ranks) that the killed-and-resumed runs must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for ranks in (1, 2):
        _run(_command(root, tiny_model_dir, f"reference{ranks}", ranks=ranks))
        out[ranks] = _metrics(root / f"reference{ranks}")
    return out


@pytest.mark.parametrize("ranks", [1, 2])
def test_kill_during_step_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, reference_runs, ranks):
    run_dir = tmp_path / "killed"
    # Killed during step 3: the step-2 checkpoint is complete, step 3's metrics are not yet written.
    _kill_when(_command(tmp_path, tiny_model_dir, "killed", ranks=ranks),
               lambda: (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists())
    _run(_command(tmp_path, tiny_model_dir, "killed", ranks=ranks, extra=["--resume"]))
    assert _stable(_metrics(run_dir)) == _stable(reference_runs[ranks])


def test_kill_during_checkpoint_save_keeps_previous(tmp_path, tiny_model_dir, reference_runs):
    from models.checkpoint import latest_checkpoint
    run_dir = tmp_path / "killed"
    # Every save pauses 2 s between writing files and marking them complete: kill inside the step-4 save.
    pausing = [sys.executable, str(ROOT / "tests" / "faults.py"), "--pause-in-save", "2", "--"]
    _kill_when(_command(tmp_path, tiny_model_dir, "killed", launcher=pausing),
               ready=lambda: (run_dir / "checkpoints" / ".step_4.partial" / "model.safetensors").exists())
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_2"
    assert not (run_dir / "checkpoints" / "step_4").exists()
    _run(_command(tmp_path, tiny_model_dir, "killed", extra=["--resume"]))
    assert _stable(_metrics(run_dir)) == _stable(reference_runs[1])
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_4"


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, tiny_model_dir, reference_runs, ranks):
    from models.checkpoint import latest_checkpoint
    run_dir = tmp_path / "interrupted"
    command = _command(tmp_path, tiny_model_dir, "interrupted", ranks=ranks, extra=["trainer.save_every=0"])
    # SIGINT to the whole process group, as a terminal's Ctrl-C sends it (torchrun then forwards its own copy).
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert process.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=300)
    steps_done = len(_metrics(run_dir))
    assert "interrupt: finishing this step" in err and "continue with --resume" in err, err[-3000:]
    if ranks == 1:  # torchrun itself ends with its own SignalException traceback
        assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    # The interrupted step was finished, not cut: the one checkpoint is at the last logged step.
    assert 1 <= steps_done < 4
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / f"step_{steps_done}"
    _run(_command(tmp_path, tiny_model_dir, "interrupted", ranks=ranks, extra=["--resume"]))
    assert _stable(_metrics(run_dir)) == _stable(reference_runs[ranks])


def _in_process(tmp_path, model_dir, run_name, steps, *extra):
    from launch.config import load_config
    from launch.dist import DistInfo
    from launch.train import parse_args, run
    args = parse_args(_command(tmp_path, model_dir, run_name, steps=steps, extra=extra)[3:])
    return run(load_config(None, args.overrides), DistInfo())


def test_flat_rewards_run_without_nan_and_say_so(tmp_path, tiny_model_dir, capsys):
    _in_process(tmp_path, tiny_model_dir, "flat", 2, "reward.functions={tests_vowels: 'rewards_for_tests:constant'}")
    for m in _metrics(tmp_path / "flat"):
        assert m["flat_group_frac"] == 1.0 and m["grad_norm"] == 0.0 and m["reward_mean"] == pytest.approx(0.7)
        assert all(v == v for v in m.values() if isinstance(v, float)), m  # no NaN
    assert "zero learning signal" in capsys.readouterr().err


def test_nonfinite_loss_skips_the_step_and_stops_after_the_limit(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from faults import nonfinite_losses
    # 2 prompts x G=4 in micro-batches of 4: two micro-batch losses per step.
    nonfinite_losses(monkeypatch, {1}, calls_per_step=2)
    _in_process(tmp_path, tiny_model_dir, "inf", 3)
    assert [m["skipped"] for m in _metrics(tmp_path / "inf")] == [0.0, 1.0, 0.0]
    assert "optimizer step skipped" in capsys.readouterr().err
    # Three non-finite steps in a row (the default limit) stop the run with a clear message, no checkpoint.
    monkeypatch.undo()
    nonfinite_losses(monkeypatch, {0, 1, 2}, calls_per_step=2)
    with pytest.raises(RuntimeError, match="3 consecutive optimizer steps skipped"):
        _in_process(tmp_path, tiny_model_dir, "stop", 4)
    assert not (tmp_path / "stop" / "checkpoints" / "step_4").exists()
