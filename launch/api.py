"""Training from Python through the same start-up checks and loop as `python -m launch.train` (under torchrun every
rank runs the same script): a recipe, overrides, reward functions of the caller's own code, rows in memory."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence

import rewards as registry
from data.rows import read_rows
from launch.dist import init_distributed, shutdown
from launch.recipe import load_config
from launch.train import run


def train(config: str | os.PathLike | Mapping | None = None, *, overrides: Sequence[str] = (),
          rewards: registry.RewardFn | Mapping[str, registry.RewardFn] | None = None,
          train_rows: Sequence[dict] | None = None, eval_rows: Sequence[dict] | None = None) -> dict:
    """Run SFT or RL (the config's stage) to the end; returns {"run_dir", "before", "after"}: the held-out results
    before and after training (count, means with 95% intervals, per-prompt values; empty without held-out rows).
    The arguments are README.md's ("In Python"): a recipe (path, dict of sections or None), `key.sub=value`
    overrides, a reward fn(data_source, solution_str, ground_truth, extra_info=None) -> float or dict (or
    {data_source: fn}) for this run only, and verl-format rows (docs/conventions.md) instead of data.*_files.
    Raises grpo.config.ConfigError for bad input (naming the key, file or row) before anything is written, and
    launch.train.RunFailed (naming the phase, the step and the rank) for a failure after start-up."""
    cfg = load_config(dict(config) if isinstance(config, Mapping) else config, list(overrides))
    dist = init_distributed(cfg)
    try:
        with registry.scoped_registry():  # the registry is as before once the run ends
            if rewards is not None:
                functions = dict(rewards) if isinstance(rewards, Mapping) else {
                    source: rewards for source in _data_sources(cfg, train_rows, eval_rows)}
                for data_source, function in functions.items():
                    registry.register(data_source, function, overwrite=True)
            summary = run(cfg, dist, rows=None if train_rows is None else list(train_rows),
                          eval_rows=None if eval_rows is None else list(eval_rows))
    finally:
        shutdown(dist)
    return {key: summary.get(key, {}) for key in ("run_dir", "before", "after")}


def _data_sources(cfg, train_rows, eval_rows) -> set[str]:
    """The data sources of the run's rows: those given, else those of data.train_files / data.eval_files."""
    rows = []
    for given, paths in ((train_rows, cfg.data.train_files), (eval_rows, cfg.data.eval_files)):
        if given is not None:
            rows += list(given)
            continue
        for path in paths:
            with contextlib.suppress(OSError, ValueError):  # the start-up checks name a missing or bad file
                rows += read_rows(path)
    return {row["data_source"] for row in rows if isinstance(row, dict) and "data_source" in row}
