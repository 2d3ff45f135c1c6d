"""Config schema: recipes parse, overrides apply, unknown keys, wrong types and numbers outside a setting's range
fail naming the key (the range table is generated from the schema, so a new numeric setting cannot escape it)."""
import dataclasses
import functools
import math
import re
import typing
from pathlib import Path

import pytest

from grpo.config import Range
from grpo.config import Config
from grpo.config import ConfigError
from launch.recipe import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_parses(recipe):
    import dataclasses

    from grpo.config import check
    cfg = load_config(CONFIGS / recipe)
    assert isinstance(cfg, Config) and cfg.stage in ("rl", "sft")
    check(dataclasses.replace(cfg, init_from=None))  # its settings agree with each other (files aside)


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


def _schema_fields(cls=Config, prefix=""):
    """(dotted key, annotation, dataclass field) of every leaf setting of the schema."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _schema_fields(hints[field.name], f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", hints[field.name], field


def _numbers(annotation) -> set:
    """The number types a setting holds: int / float, also inside Optional[...] and list[...]."""
    if annotation in (int, float):
        return {annotation}
    return set().union(*[_numbers(arg) for arg in typing.get_args(annotation)]) if typing.get_args(annotation) else set()


RANGED = [(key, annotation, field.metadata["range"]) for key, annotation, field in _schema_fields()
          if "range" in field.metadata]


def test_every_numeric_setting_declares_its_range():
    unranged = [key for key, annotation, field in _schema_fields() if _numbers(annotation) and "range" not in field.metadata]
    assert not unranged, f"numeric settings without bounded(...) in grpo/config.py: {unranged}"
    assert len(RANGED) >= 50


def _outside(valid: Range, integer: bool) -> list:
    """Values just outside `valid` on each bounded side (the bound itself where that end is open); floats also
    get NaN and infinity."""
    step = 1 if integer else 0.5
    values = []
    if valid.low is not None:
        values.append(valid.low if valid.low_open else valid.low - step)
    if valid.high is not None:
        values.append(valid.high if valid.high_open else valid.high + step)
    return [int(v) if integer else float(v) for v in values] + ([] if integer else [math.nan, math.inf])


def _inside(valid: Range, integer: bool) -> list:
    """The closed bounds, which must be accepted."""
    values = [bound for bound, is_open in ((valid.low, valid.low_open), (valid.high, valid.high_open))
              if bound is not None and not is_open]
    return [int(v) if integer else float(v) for v in values]


def _yaml(value) -> str:
    return {math.inf: ".inf"}.get(value, ".nan" if value != value else repr(value))


@pytest.mark.parametrize("key, annotation, valid", RANGED, ids=[key for key, _, _ in RANGED])
def test_each_ranged_setting_refuses_values_outside_its_range(key, annotation, valid):
    integer = _numbers(annotation) == {int}
    is_list = typing.get_origin(annotation) is list
    assert _outside(valid, integer), f"{key}: {valid} refuses nothing"
    for value in _outside(valid, integer):
        text = f"[{_yaml(value)}]" if is_list else _yaml(value)
        named = f"{key}[0]" if is_list else key
        with pytest.raises(ConfigError, match=re.escape(f"{named}={value!r} is out of range: it must be {valid}")):
            load_config(None, [f"{key}={text}"])
    for value in _inside(valid, integer):
        cfg = load_config(None, [f"{key}=[{value!r}]" if is_list else f"{key}={value!r}"])
        section, name = key.rsplit(".", 1) if "." in key else ("", key)
        holder = functools.reduce(getattr, section.split(".") if section else [], cfg)
        assert getattr(holder, name) == ([value] if is_list else value)
