"""Reading a recipe (a YAML file, a dict of its sections, or nothing) plus `key.sub=value` overrides into the typed
Config of grpo/config.py; unknown keys (the closest valid one suggested) and wrong types fail here, naming the key."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path

import yaml

from grpo.config import Config, ConfigError


def _coerce(value, tp, key: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats. Raises ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # the schema's unions are all `X | None`
        if value is None:
            return None
        [tp] = [arg for arg in args if arg is not type(None)]
        return _coerce(value, tp, key)
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # data.train_files=/path.jsonl: a one-file list
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(k, args[0], key): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 3e-6 (no dot) as a string
            return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [spec.name for spec in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        tp = hints[key]
        kwargs[key] = (_build(tp, value, f"{prefix}{key}.") if dataclasses.is_dataclass(tp)
                       else _coerce(value, tp, f"{prefix}{key}"))
    return cls(**kwargs)  # the section checks its choices and ranges (grpo.config.Section)


def load_config(path: str | Path | dict | None = None, overrides: list[str] = ()) -> Config:
    """A YAML recipe (or a dict of its sections, or the defaults) with `key.sub=value` overrides (values as YAML)."""
    tree: dict = {}
    if isinstance(path, dict):
        tree, path = copy.deepcopy(path), None
    elif path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(tree).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        *sections, name = key.strip().split(".")
        section = tree
        for part in sections:
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise ConfigError(f"override {key.strip()}: {part} is not a section")
        section[name] = yaml.safe_load(raw) if raw.strip() else ""
    where = f" (in {path})" if path else ""
    try:
        return _build(Config, tree)
    except ConfigError as error:
        raise ConfigError(f"{error}{where}") from None
