"""The run directory's records: the settings of every start, metrics.jsonl, samples.jsonl, a tqdm bar with the live
reward, optional TensorBoard and Weights & Biases. Only rank 0 writes; other ranks' methods do nothing."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path

import yaml
from tqdm import tqdm

from grpo.config import Config


def jsonable(value):
    """`value` with every non-finite float as None, which JSON writes as null (docs/conventions.md); the key stays."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


class RunLog:
    """A run's log from `start_step` on: config.yaml at step 0, config_step_<n>.yaml at each resume (what a resume
    compares with); lines of metrics.jsonl and samples.jsonl after the start dropped (a resume redoes them)."""

    def __init__(self, cfg: Config, run_dir: Path, *, start_step: int = 0, enabled: bool = True):
        self.enabled, self.run_dir = enabled, Path(run_dir)
        self.bar = self.tensorboard = self.wandb = None
        self.closing = contextlib.ExitStack()  # what close() ends: the bar, TensorBoard's writer, the W&B run
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        settings = dataclasses.asdict(cfg)
        if start_step == 0:
            for earlier in self.run_dir.glob("config_step_*.yaml"):
                earlier.unlink()
        name = "config.yaml" if start_step == 0 else f"config_step_{start_step}.yaml"
        (self.run_dir / name).write_text(yaml.safe_dump(settings, sort_keys=False))
        for path in (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl"):
            if path.exists():
                kept = [line for line in path.read_text().splitlines() if line.strip()
                        and json.loads(line).get("step", 0) <= start_step]
                path.write_text("".join(line + "\n" for line in kept))
        if cfg.trainer.wandb_project:
            import wandb
            self.wandb = wandb.init(project=cfg.trainer.wandb_project, name=self.run_dir.name,
                                    dir=str(self.run_dir), config=settings, resume="allow")
            self.closing.callback(self.wandb.finish)
        self.bar = self.closing.enter_context(tqdm(total=cfg.trainer.steps, initial=start_step, desc=cfg.stage,
                                                   dynamic_ncols=True, file=sys.stderr))
        with contextlib.suppress(Exception):  # optional: only when installed
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = self.closing.enter_context(SummaryWriter(str(self.run_dir / "tensorboard")))

    def metrics(self, step: int, metrics: dict, postfix_keys: tuple[str, ...] = ("reward_mean",)) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as file:
            file.write(json.dumps({"step": step, **jsonable(metrics)}) + "\n")
        numbers = {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        self.bar.set_postfix({k: f"{metrics[k]:.3f}" for k in postfix_keys if k in metrics})
        self.bar.update(1)

    def samples(self, step: int, samples: list[dict]) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / "samples.jsonl", "a") as file:
            file.writelines(json.dumps({"step": step, **sample}) + "\n" for sample in samples)

    def warn(self, message: str) -> None:
        self.info(f"WARNING: {message}")

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        self.closing.close()
