"""Failures: kill -9 during a step and during a checkpoint save (one process and 2-rank torchrun), Ctrl-C and
SIGTERM, then resume to the same metrics as an uninterrupted run; a killed rank that torchrun restarts and that
resumes by itself; hangs (a frozen rank, a stalled weight sync, a hung reward) that end as named errors; a
checkpoint write that fails; flat rewards; injected non-finite losses."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import free_port, signal_after_first_step

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


# Ctrl-C and SIGTERM share one handler: Ctrl-C in one process, SIGTERM in one process and on both ranks.
@pytest.mark.parametrize("ranks, stop_signal", [(1, signal.SIGINT), (1, signal.SIGTERM), (2, signal.SIGTERM)],
                         ids=["ctrl-c-1", "sigterm-1", "sigterm-2"])
def test_stop_signal_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, tiny_model_dir, reference_runs,
                                                                       ranks, stop_signal):
    """Ctrl-C, and a scheduler's preemption (SIGTERM), on every rank."""
    from models.checkpoint import latest_checkpoint
    run_dir = tmp_path / "interrupted"
    command = _command(tmp_path, tiny_model_dir, "interrupted", ranks=ranks, extra=["trainer.save_every=0"])
    returncode, err = signal_after_first_step(command, run_dir, stop_signal, ROOT, _env())
    steps_done = len(_metrics(run_dir))
    name = signal.Signals(stop_signal).name
    assert f"{name}: finishing this step" in err, err[-3000:]
    for rank in range(ranks):
        assert f"rank {rank}: stopped by {name} after step {steps_done}" in err and "trainer.resume=auto" in err, err[-3000:]
    if ranks == 1:  # torchrun itself ends with its own SignalException traceback
        assert returncode == 128 + stop_signal and "Traceback" not in err, err[-3000:]
    # The interrupted step was finished, not cut: the one checkpoint is at the last logged step.
    assert 1 <= steps_done < 4
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / f"step_{steps_done}"
    _run(_command(tmp_path, tiny_model_dir, "interrupted", ranks=ranks, extra=["--resume"]))
    assert _stable(_metrics(run_dir)) == _stable(reference_runs[ranks])


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_rank_exits_with_its_code_and_its_output_but_without_the_interpreter_teardown(world_size):
    """launch.dist.exit_rank: a torchrun rank's block-buffered stdout still arrives, the exit code is kept, and
    the interpreter's teardown (an atexit hook stands for it) is skipped; one process exits as usual."""
    script = ("import atexit, sys\n"
              "from launch.dist import exit_rank\n"
              "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
              "sys.stdout.write('buffered output')\n"
              "exit_rank(3)\n")
    env = {k: v for k, v in _env(WORLD_SIZE=world_size).items() if k != "PYTHONUNBUFFERED"}  # a pipe buffers
    finished = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 3, finished.stderr
    assert finished.stdout == "buffered output"
    assert ("teardown ran" in finished.stderr) == (world_size == "1"), finished.stderr


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=rank (its children carry their rank in the environment)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == torchrun_pid \
                    and f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {torchrun_pid}")


def _wait_for(condition, process, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_killed_rank_restarts_and_resumes_by_itself(tmp_path, tiny_model_dir, reference_runs):
    """torchrun --max-restarts restarts the group after a rank's kill -9; trainer.resume=auto continues from the
    latest complete checkpoint, and the steps after it equal the uninterrupted run's."""
    run_dir = tmp_path / "elastic"
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2", "--max-restarts=1",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "launch.train"]
    command = _command(tmp_path, tiny_model_dir, "elastic", launcher=torchrun, extra=["trainer.resume=auto"])
    with open(tmp_path / "stderr.txt", "w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
                                   start_new_session=True)
        # Killed during step 3: the step-2 checkpoint is complete, step 3's metrics are not yet written.
        _wait_for(lambda: (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists(), process, "the step-2 checkpoint")
        os.kill(_rank_pid(process.pid, 1), signal.SIGKILL)
        assert process.wait(timeout=400) == 0, (tmp_path / "stderr.txt").read_text()[-5000:]
    assert len(_metrics(run_dir)) == 4 and _stable(_metrics(run_dir)) == _stable(reference_runs[2])


def test_rank_that_stops_answering_ends_the_run_naming_phase_step_and_rank(tmp_path, tiny_model_dir):
    """A frozen rank (SIGSTOP) leaves the other waiting in a collective: after trainer.collective_timeout_s it
    fails with the phase, the step and its rank named, instead of hanging."""
    command = _command(tmp_path, tiny_model_dir, "frozen", ranks=2, extra=["trainer.collective_timeout_s=5"])
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
                                   start_new_session=True)
        frozen = None
        try:
            _wait_for(lambda: (tmp_path / "frozen" / "metrics.jsonl").exists(), process, "the first step")
            frozen = _rank_pid(process.pid, 1)
            os.kill(frozen, signal.SIGSTOP)
            started = time.time()
            _wait_for(lambda: "RunFailed" in errors.read_text(), process, "rank 0's error", timeout=120)
            waited = time.time() - started
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            if frozen is not None:  # torchrun's workers may sit in a process group of their own; a stopped
                try:                # process answers nothing but SIGKILL
                    os.kill(frozen, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
    text = errors.read_text()
    assert re.search(r"RunFailed: [\w ()]+ failed at step [2-4] on rank 0: .*Timed out waiting 5000ms.*\(a collective "
                     r"waited longer than trainer\.collective_timeout_s=5 s: another rank stopped answering\)", text), text[-5000:]
    assert waited < 60, waited


def test_stalled_weight_sync_ends_the_run_naming_phase_step_and_rank(tmp_path, tiny_model_dir):
    # Sync calls: 1 at start-up, then one per step: the 3rd is step 2's.
    stalling = [sys.executable, str(ROOT / "tests" / "faults.py"), "--stall-sync-at", "3", "--"]
    finished = subprocess.run(_command(tmp_path, tiny_model_dir, "stalled", launcher=stalling,
                                       extra=["rollout.sync_timeout_s=2"]),
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert finished.returncode == 124, finished.stderr[-3000:]
    assert "error: weight sync (phase: sync) at step 2 on rank 0 did not finish within rollout.sync_timeout_s=2 s" \
        in finished.stderr, finished.stderr[-3000:]
    assert "stalling_sync" in finished.stderr  # the stack of the stalled thread says where it stopped
    assert len(_metrics(tmp_path / "stalled")) == 1


def test_failed_checkpoint_write_keeps_the_previous_one_and_resumes(tmp_path, tiny_model_dir, reference_runs):
    """A checkpoint that cannot be written (the disk is full: here, no file may grow past 1 MiB after the first
    save) ends the run naming the path and the bytes needed; the previous checkpoint stays the latest, resuming
    from it reproduces the run, and keep_last deletes it only once a newer one is complete."""
    from models.checkpoint import latest_checkpoint
    checkpoints = tmp_path / "full" / "checkpoints"
    limited = [sys.executable, str(ROOT / "tests" / "faults.py"), "--file-size-limit-after-saves", "1", str(1 << 20), "--"]
    finished = subprocess.run(_command(tmp_path, tiny_model_dir, "full", launcher=limited, extra=["trainer.keep_last=1"]),
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert re.search(rf"RunFailed: checkpoint failed at step 4 on rank 0: CheckpointWriteError: writing checkpoint "
                     rf"{re.escape(str(checkpoints / 'step_4'))} failed on rank 0 while writing the weights: .*File too "
                     rf"large.*It needs about [\d,]+ bytes", finished.stderr), finished.stderr[-3000:]
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step_2"]  # no partial directory left
    assert latest_checkpoint(checkpoints) == checkpoints / "step_2"
    _run(_command(tmp_path, tiny_model_dir, "full", extra=["trainer.keep_last=1", "--resume"]))
    assert _stable(_metrics(tmp_path / "full")) == _stable(reference_runs[1])
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step_4"]


def _in_process(tmp_path, model_dir, run_name, steps, *extra):
    from launch.recipe import load_config
    from launch.dist import DistInfo
    from launch.train import parse_args, run
    args = parse_args(_command(tmp_path, model_dir, run_name, steps=steps, extra=extra)[3:])
    return run(load_config(None, args.overrides + (["trainer.resume=always"] if args.resume else [])), DistInfo())


def test_failed_evaluation_ends_the_run_naming_the_step_and_keeps_the_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    """A held-out evaluation that fails mid-run (here: the third one, after step 2) stops the run naming the
    phase and the step; the last checkpoint (step 1) is complete, and resuming from it finishes the run."""
    import grpo.evaluate  # LocalRollout.evaluate looks the function up there at each call
    from launch.train import RunFailed
    from models.checkpoint import latest_checkpoint
    rows = _rows(tmp_path / "rows.jsonl")
    original, calls = grpo.evaluate.evaluate, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 0, step 1, then step 2's
            raise RuntimeError("reward service unreachable")
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo.evaluate, "evaluate", failing)
    with pytest.raises(RunFailed, match=r"held-out evaluation failed at step 2 on rank 0: RuntimeError: reward "
                                        r"service unreachable"):
        _in_process(tmp_path, tiny_model_dir, "evalfail", 4, f"data.eval_files=['{rows}']", "trainer.eval_every=1",
                    "trainer.save_every=1", "data.eval_size=2")
    assert latest_checkpoint(tmp_path / "evalfail" / "checkpoints") == tmp_path / "evalfail" / "checkpoints" / "step_1"
    monkeypatch.setattr(grpo.evaluate, "evaluate", original)
    summary = _in_process(tmp_path, tiny_model_dir, "evalfail", 4, f"data.eval_files=['{rows}']", "trainer.eval_every=1",
                          "trainer.save_every=1", "data.eval_size=2", "--resume")
    assert [record["step"] for record in _metrics(tmp_path / "evalfail") if "eval/reward" in record][-1] == 4
    assert summary["after"]["count"] == 2


def test_hung_reward_ends_the_run_naming_phase_step_rank_and_row(tmp_path, tiny_model_dir, reference_runs):
    """Rewards scored in worker processes: a reward that never returns is abandoned after reward.timeout_s, and the
    steps before it were scored exactly as the serial reference run scored them."""
    import torch

    from launch.train import RunFailed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference run's OMP_NUM_THREADS=1: float sums then add up in the same order
    try:  # this run's sampler reaches row index 5 in step 3
        with pytest.raises(RunFailed, match=r"rollout_reward failed at step 3 on rank 0: RuntimeError: reward "
                                            r"'tests_vowels' failed on row index 5: no result within reward\.timeout_s=2 s"):
            _in_process(tmp_path, tiny_model_dir, "hung", 4, "reward.num_workers=2", "reward.timeout_s=2",
                        "reward.functions={tests_vowels: 'rewards_for_tests:hangs_on_row_5'}")
    finally:
        torch.set_num_threads(threads)
    hung, reference = _stable(_metrics(tmp_path / "hung")), _stable(reference_runs[1])[:2]
    assert hung == reference, [(k, a[k], b.get(k)) for a, b in zip(hung, reference) for k in a if a[k] != b.get(k)]


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
