"""Reward functions behind one verl-compatible entry point, `compute_score`, and a registry by data_source.

A reward function has verl's signature `fn(data_source, solution_str, ground_truth, extra_info=None)` and
returns a float, or a dict with "score" (float), optionally "sentences" ([(char_start, char_end, reward)]
over solution_str) and named float components. The shipped ones are registered at the end of this file.

Add your own with `register("name", fn)` or `@register("name")`, or name one by path wherever a
data_source is expected: "package.module.function", "package.module:function" or "path/to/file.py:function".
No reward imports torch or a tokenizer library."""
from __future__ import annotations

import contextlib
import importlib
import math
import runpy
from collections.abc import Callable

from rewards.arithmetic import arithmetic_reward
from rewards.factqa import factqa_corpus_reward
from rewards.scifact import evidence_qa_reward, scifact_evidence_reward
from rewards.verifier import verifier_reward

RewardFn = Callable[..., "float | dict"]
_REGISTRY: dict[str, RewardFn] = {}


def register(data_source: str, fn: RewardFn | None = None, *, overwrite: bool = False):
    """Register fn under data_source; without fn, return a decorator. A taken name needs overwrite=True."""
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"data_source must be a non-empty string, got {data_source!r}")

    def add(function: RewardFn) -> RewardFn:
        if not callable(function):
            raise ValueError(f"reward for {data_source!r} must be callable, got {type(function).__name__}")
        existing = _REGISTRY.get(data_source)
        if existing is not None and existing is not function and not overwrite:
            raise ValueError(f"data_source {data_source!r} is already registered to {existing.__module__}."
                             f"{existing.__qualname__}; pass overwrite=True to replace it")
        _REGISTRY[data_source] = function
        return function

    return add if fn is None else add(fn)


def registered() -> list[str]:
    return sorted(_REGISTRY)


def load_function(name: str) -> Callable:
    """The function a path names (as a data_source, or launch.self_filter's --judge); ValueError saying why not."""
    module_name, _, attribute = name.rpartition(":" if ":" in name else ".")
    if not module_name or not attribute:
        raise ValueError("not registered")
    try:
        if module_name.endswith(".py"):
            namespace = runpy.run_path(module_name)
        else:
            namespace = vars(importlib.import_module(module_name))
    except (ImportError, OSError) as error:  # OSError: no such .py file
        raise ValueError(f"cannot import {module_name}: {error}") from None
    function = namespace.get(attribute)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {attribute!r}")
    return function


def get_reward(data_source_or_path: str) -> RewardFn:
    """The registered function, else the one a path names (registered then); ValueError otherwise."""
    function = _REGISTRY.get(data_source_or_path)
    if function is None:
        try:
            if not isinstance(data_source_or_path, str) or not data_source_or_path:
                raise ValueError("not a name")
            function = _REGISTRY[data_source_or_path] = load_function(data_source_or_path)
        except ValueError as error:
            raise ValueError(f"unknown reward {str(data_source_or_path)!r} ({error}); registered data sources: "
                             f"{', '.join(registered())}; or give a path 'package.module.function', "
                             "'package.module:function' or 'file.py:function'") from None
    return function


@contextlib.contextmanager
def scoped_registry():
    """Registrations made inside are undone on leaving (launch.api.train: a run's rewards are its own)."""
    saved = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def compute_score(data_source: str, solution_str: str, ground_truth: object,
                  extra_info: dict | None = None) -> float | dict:
    """verl's entry point: the reward for data_source on one completion, if it is a finite number (returned as a
    float) or a dict with a finite "score" and sentence spans inside the completion; ValueError naming the reward
    and the value otherwise."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    result = get_reward(data_source)(data_source, solution_str, ground_truth, extra_info)
    score = result.get("score") if isinstance(result, dict) else result
    if not isinstance(score, (int, float)) or not math.isfinite(score):  # bool is an int: True scores 1
        raise ValueError(f"reward {data_source!r} returned {result!r:.200}: expected a finite number or a dict with "
                         f"a finite 'score'")
    if not isinstance(result, dict):
        return float(score)
    for start, end, _ in result.get("sentences") or ():
        if not 0 <= start <= end <= len(solution_str):
            raise ValueError(f"reward {data_source!r} returned sentence span ({start}, {end}) outside "
                             f"the {len(solution_str)}-character solution")
    return result


register("scifact_evidence", scifact_evidence_reward)
register("evidence_qa", evidence_qa_reward)
register("verifier", verifier_reward)
register("factqa_corpus", factqa_corpus_reward)
register("arithmetic", arithmetic_reward)
