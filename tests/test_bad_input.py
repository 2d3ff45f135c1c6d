"""Bad input fails at start-up through the real entry point with a message that names the file, line, key or
value (exit code 2, no traceback), and nothing is written to the run directory."""
import json
import re
import shutil

import pytest

from launch.train import main

GOOD_ROW = {"prompt": [{"role": "user", "content": "Hi"}], "data_source": "tests_vowels",
            "reward_model": {"ground_truth": "{}"}, "extra_info": {"index": 0}}


def _write(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


@pytest.fixture
def setup(tmp_path, tiny_model_dir):
    rows = _write(tmp_path / "rows.jsonl", [GOOD_ROW, {**GOOD_ROW, "extra_info": {"index": 1}}])
    base = [f"model.name_or_path={tiny_model_dir}", f"data.train_files=['{rows}']",
            "reward.functions={tests_vowels: 'rewards_for_tests:vowel_fraction'}", "rollout.max_new_tokens=4",
            f"trainer.out_dir={tmp_path / 'runs'}", "trainer.run_name=bad", "trainer.steps=1"]
    return tmp_path, base


def _data_cases(tmp):
    junk = tmp / "junk.jsonl"
    junk.write_bytes(bytes(range(256)) * 4)
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    return [
        ("missing field", _write(tmp / "a.jsonl", [GOOD_ROW, {"data_source": "tests_vowels"}]), r"a\.jsonl:2.*'prompt'"),
        ("wrong type", _write(tmp / "b.jsonl", [{**GOOD_ROW, "data_source": 7}]), r"b\.jsonl:1.*data_source"),
        ("empty file", empty, r"empty\.jsonl.*empty"),
        ("binary junk", junk, r"junk\.jsonl"),
        ("10 MB line", _write(tmp / "big.jsonl", [{**GOOD_ROW, "pad": "x" * 10_000_000}]), r"big\.jsonl:1"),
        ("unknown reward", _write(tmp / "c.jsonl", [{**GOOD_ROW, "data_source": "nope"}]), r"data_source 'nope'"),
    ]


def _assert_refused(code: int, message: str, capsys, tmp, overrides) -> None:
    """Exit 2 with `message` on stderr, no traceback, and no run directory written."""
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), (overrides, err[-600:])
    assert "Traceback" not in err and not (tmp / "runs").exists(), overrides


def test_bad_data_files(setup, capsys):
    tmp, base = setup
    for name, path, message in _data_cases(tmp):
        code = main(base + [f"data.train_files=['{path}']"])
        err = capsys.readouterr().err
        assert code == 2, name
        assert pytest.importorskip("re").search(message, err), (name, err[-500:])
        assert "Traceback" not in err and not (tmp / "runs").exists(), name


def test_bad_configs_models_and_checkpoints(setup, capsys, tiny_model_dir):
    tmp, base = setup
    no_weights = tmp / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    broken_yaml = tmp / "broken.yaml"
    broken_yaml.write_text("trainer: [1, 2\n")
    cases = [
        (["optim.lrr=1"], r"optim\.lrr; did you mean optim\.lr\?"),
        (["rollout.n=two"], r"rollout\.n: expected int, got 'two'"),
        (["--config", str(tmp / "missing.yaml")], r"config file not found: .*missing\.yaml"),
        (["--config", str(broken_yaml)], r"broken\.yaml: not valid YAML"),
        (["rollout.n=1"], r"rollout\.n=1"),
        (["trainer.micro_batch_size=3"], r"trainer\.micro_batch_size=3 does not divide"),
        (["rollout.num_threads=0"], r"rollout\.num_threads=0 is out of range: it must be >= 1"),
        (["data.max_prompt_tokens=3"], r"longer than data\.max_prompt_tokens=3"),
        ([f"model.name_or_path={tmp / 'nowhere'}"], r"model\.name_or_path: .*nowhere"),
        ([f"model.name_or_path={no_weights}"], r"model\.name_or_path: .*no_weights"),
        ([f"init_from={tmp / 'no_ckpt'}"], r"init_from: checkpoint directory not found"),
        (["reward.corpus_index=/nonexistent/index"], r"reward\.corpus_index: .*rewards\.corpus build"),
        (["--resume"], r"--resume: no complete checkpoint"),
    ]
    for overrides, message in cases:
        _assert_refused(main(base + overrides), message, capsys, tmp, overrides)


def test_corrupt_checkpoint_is_refused(setup, capsys):
    tmp, base = setup
    assert main(base + ["trainer.steps=1"]) == 0
    capsys.readouterr()
    checkpoint = tmp / "runs" / "bad" / "checkpoints" / "step_1"
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: the size no longer matches COMPLETE
    before = (tmp / "runs" / "bad" / "metrics.jsonl").read_text()
    assert main(base + ["trainer.steps=2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err, err[-600:]
    assert (tmp / "runs" / "bad" / "metrics.jsonl").read_text() == before
    shutil.rmtree(checkpoint)


def test_an_overlong_prompt_names_its_file_and_line_or_is_dropped_and_counted(setup, capsys):
    """On 5cd6fe9: 'row index 26 has a 1667-token prompt', no file, no line, and no option to drop such rows."""
    tmp, base = setup
    long_row = {**GOOD_ROW, "prompt": [{"role": "user", "content": "word " * 300}], "extra_info": {}}
    rows = _write(tmp / "long.jsonl", [GOOD_ROW, long_row, {**GOOD_ROW, "extra_info": {"index": 2}}])
    base = base + [f"data.train_files=['{rows}']", "data.max_prompt_tokens=64"]
    assert main(base + ["--dry-run"]) == 2
    assert f"{rows}:2: a " in capsys.readouterr().err
    assert main(base + ["data.filter_overlong_prompts=true", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "ok: 2 training rows" in out and f"1 of 3 rows dropped" in err and f"(the first: {rows}:2)" in err


BAD_REWARDS = """
def two_arguments(data_source, solution_str):
    return 1.0

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "good"

def nothing(data_source, solution_str, ground_truth, extra_info=None):
    return None

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
"""


def test_a_bad_reward_is_refused_at_start_up_before_the_model_loads(setup, capsys):
    """A wrong signature or a result that is not a finite number or a dict with a finite score ends the start-up
    (and --dry-run) in one line naming the reward, the row and the value; on 5cd6fe9 it surfaced after the first
    rollout as a long traceback."""
    tmp, base = setup
    (tmp / "bad_rewards.py").write_text(BAD_REWARDS)
    for name, shown in (("two_arguments", "TypeError"), ("not_a_number", "nan"), ("text", "'good'"),
                        ("nothing", "None"), ("no_score", "{'acc': 1.0}")):
        reward = f"reward.functions={{tests_vowels: '{tmp / 'bad_rewards.py'}:{name}'}}"
        for flags in ([], ["--dry-run"]):
            code = main(base + [reward, *flags])
            err = capsys.readouterr().err
            assert code == 2 and len(err.strip().splitlines()) == 1, (name, err[-600:])
            assert f"reward 'tests_vowels' on {tmp / 'rows.jsonl'}:1 with an empty completion" in err and shown in err
            assert not (tmp / "runs").exists()


def test_dry_run_of_a_shipped_recipe_names_the_command_that_makes_a_missing_file(tmp_path, monkeypatch, capsys):
    """On a fresh clone the README's commands meet files that make demo (or a data converter) writes; on 5cd6fe9
    the message named the file only."""
    from pathlib import Path
    configs = Path(__file__).resolve().parents[1] / "launch" / "configs"
    monkeypatch.chdir(tmp_path)
    for recipe, overrides, maker in (("demo.yaml", [], "make demo"), ("demo.yaml", ["init_from=null"], "make demo"),
                                     ("veriseek_grpo.yaml", [], "python -m data.scifact"),
                                     ("verifier_dapo.yaml", [], "python -m launch.train --config "
                                                                "launch/configs/verifier_sft.yaml")):
        assert main(["--config", str(configs / recipe), "--dry-run", *overrides]) == 2
        assert f"(made by: {maker}" in capsys.readouterr().err, recipe


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size: only a checksum can tell
    path.write_bytes(bytes(data))


def test_a_flipped_bit_anywhere_in_a_checkpoint_is_refused_naming_the_file(setup, capsys):
    """Weights or optimizer state damaged without a change of size: refused by --resume --dry-run and --resume,
    naming the file, and nothing trains from it; trainer.resume_fallback resumes from the intact step before
    (on 5cd6fe9 --dry-run said ok and the weights loaded)."""
    tmp, base = setup
    assert main(base + ["trainer.steps=2", "trainer.save_every=1"]) == 0
    run = tmp / "runs" / "bad"
    before = (run / "metrics.jsonl").read_text()
    for damaged in (run / "checkpoints" / "step_2" / "model.safetensors",
                    max((run / "checkpoints" / "step_2" / "optimizer").iterdir(), key=lambda p: p.stat().st_size)):
        intact = damaged.read_bytes()
        _flip_a_bit(damaged)
        for flags in (["--resume", "--dry-run"], ["--resume"]):
            assert main(base + ["trainer.steps=3", *flags]) == 2, (damaged, flags)
            err = capsys.readouterr().err
            assert f"{damaged} is damaged" in err and "Traceback" not in err, err[-600:]
        assert (run / "metrics.jsonl").read_text() == before
        damaged.write_bytes(intact)
    _flip_a_bit(run / "checkpoints" / "step_2" / "model.safetensors")
    assert main(base + ["trainer.steps=3", "trainer.resume_fallback=true", "--resume", "--dry-run"]) == 0
    assert "would resume from " + str(run / "checkpoints" / "step_1") in capsys.readouterr().out


def test_checkpoint_policy_weights_only_or_none(setup, capsys):
    """trainer.checkpoint=weights writes no optimizer state (a third of the bytes) and is refused as a resume
    point, naming what it can do; none writes nothing (on 5cd6fe9 every checkpoint held the optimizer)."""
    tmp, base = setup
    assert main(base + ["trainer.run_name=full"]) == 0
    assert main(base + ["trainer.run_name=weights", "trainer.checkpoint=weights"]) == 0
    sizes = {name: sum(p.stat().st_size for p in (tmp / "runs" / name).rglob("*") if p.is_file())
             for name in ("full", "weights")}
    assert not (tmp / "runs" / "weights" / "checkpoints" / "step_1" / "optimizer").exists()
    assert sizes["weights"] < sizes["full"] / 2, sizes
    capsys.readouterr()
    assert main(base + ["trainer.run_name=weights", "trainer.steps=2", "--resume"]) == 2
    assert "holds no optimizer state" in capsys.readouterr().err
    assert main(base + ["trainer.run_name=none", "trainer.checkpoint=none"]) == 0
    assert (tmp / "runs" / "none" / "metrics.jsonl").is_file() and not (tmp / "runs" / "none" / "checkpoints").exists()


# What a new user tried: each was accepted by --dry-run, and prompts_per_step=0 crashed deep in the loop
# after writing a run directory. Each must now fail at start-up naming the key, the value and the range.
NONSENSE = [
    ("trainer.steps=-1", r"trainer\.steps=-1 is out of range: it must be >= 1"),
    ("optim.lr=-1", r"optim\.lr=-1\.0 is out of range: it must be > 0"),
    ("rollout.max_new_tokens=0", r"rollout\.max_new_tokens=0 is out of range: it must be >= 1"),
    ("rollout.temperature=-1", r"rollout\.temperature=-1\.0 is out of range: it must be > 0"),
    ("rollout.top_p=1.5", r"rollout\.top_p=1\.5 is out of range: it must be in \(0, 1\]"),
    ("algorithm.clip_low=2", r"algorithm\.clip_low=2\.0 is out of range: it must be in \[0, 1\)"),
    ("algorithm.kl_coef=-1", r"algorithm\.kl_coef=-1\.0 is out of range: it must be >= 0"),
    ("trainer.prompts_per_step=0", r"trainer\.prompts_per_step=0 is out of range: it must be >= 1"),
    ("reward.timeout_s=0", r"reward\.timeout_s=0\.0 is out of range: it must be > 0"),
    ("reward.num_workers=-2", r"reward\.num_workers=-2 is out of range: it must be >= 0"),
    ("trainer.collective_timeout_s=-5", r"trainer\.collective_timeout_s=-5\.0 is out of range: it must be > 0"),
    ("rollout.sync_timeout_s=0", r"rollout\.sync_timeout_s=0\.0 is out of range: it must be > 0"),
    # Settings that are each in range but do not fit together (the fixture's run has 1 step, no held-out rows).
    ("trainer.eval_every=2", r"trainer\.eval_every=2 exceeds trainer\.steps=1"),
    ("trainer.steps=4 trainer.eval_every=2", r"trainer\.eval_every=2 needs held-out rows: data\.eval_files is empty"),
    ("reward.timeout_s=5", r"reward\.timeout_s=5\.0 needs reward\.num_workers >= 1"),
    ("data.max_prompt_tokens=3", r"longer than data\.max_prompt_tokens=3"),  # needs the tokenizer only
]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "start"])
def test_nonsense_settings_are_refused_at_start_up(setup, capsys, monkeypatch, dry_run):

    import models
    tmp, base = setup
    # Everything here must be refused before any model loads (the tokenizer is allowed).
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the checks"))
    for overrides, message in NONSENSE:
        code = main(base + overrides.split() + (["--dry-run"] if dry_run else []))
        _assert_refused(code, message, capsys, tmp, overrides)


def test_dry_run_checks_and_writes_nothing(setup, capsys):
    tmp, base = setup
    assert main(base + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ok: 2 training rows, 0 held-out rows, longest prompt" in out and "data.max_prompt_tokens=1024" in out
    assert not (tmp / "runs").exists()
