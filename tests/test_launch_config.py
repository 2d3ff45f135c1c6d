"""Config schema: recipes parse, overrides apply, unknown keys and wrong types fail naming the key."""
from pathlib import Path

import pytest

from grpo.config import Config
from launch.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_parses(recipe):
    cfg = load_config(CONFIGS / recipe)
    assert isinstance(cfg, Config) and cfg.stage in ("rl", "sft")


def test_overrides_apply_and_coerce():
    cfg = load_config(None, ["optim.lr=3e-6", "rollout.n=8", "algorithm.dual_clip=3", "rollout.stop=['</answer>']",
                             "model.name_or_path=/tmp/x", "algorithm.tis_cap=null"])
    assert cfg.optim.lr == 3e-6 and cfg.rollout.n == 8 and cfg.algorithm.dual_clip == 3.0
    assert cfg.rollout.stop == ["</answer>"] and cfg.model.name_or_path == "/tmp/x" and cfg.algorithm.tis_cap is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown config key optim.lrr; did you mean optim.lr?"),
        ("rollout.n=four", "rollout.n: expected int, got 'four'"),
        ("algorithm.agg=mean", "algorithm.agg: 'mean' is not one of token-mean"),
        ("trainer.steps=1.5", "trainer.steps: expected int, got 1.5"),
        ("model.gradient_checkpointing=1", "expected bool, got 1"),
        ("optim=3", "optim: expected a mapping"),
        ("nonsense", "must look like key.sub=value"),
        ("algorithmm.kl_coef=0.1", "did you mean algorithm?"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: rl\n  oops: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"rollout\.temprature; did you mean rollout\.temperature\? \(in .*typo\.yaml\)"):
        load_config(typo)
