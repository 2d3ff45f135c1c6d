"""The run directory's logs: metrics.jsonl, samples.jsonl, a tqdm bar with the live reward, optional TensorBoard.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm


def jsonable(value):
    """`value` with every non-finite float as None: JSON has no NaN or infinity, so metrics.jsonl, eval.json and
    launch.train's result write null there (docs/conventions.md); the key stays, so a gap stays visible."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


class RunLog:
    """wandb_project: also log every step's numbers to Weights & Biases (imported only then; WANDB_MODE=offline
    writes the run under run_dir/wandb without a network), with `config` as the run's configuration."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int = 0, enabled: bool = True,
                 description: str = "train", wandb_project: str | None = None, config: dict | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.bar = None
        self.tensorboard = None
        self.wandb = None
        if not enabled:
            return
        if wandb_project:
            import wandb
            self.wandb = wandb.init(project=wandb_project, name=self.run_dir.name, dir=str(self.run_dir),
                                    config=config, resume="allow")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=total_steps, initial=start_step, desc=description, dynamic_ncols=True,
                        file=sys.stderr)
        try:  # optional: only when installed
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
        except Exception:
            self.tensorboard = None

    def metrics(self, step: int, metrics: dict, postfix_keys: tuple[str, ...] = ("reward_mean",)) -> None:
        if not self.enabled:
            return
        record = {"step": step, **jsonable(metrics)}
        with open(self.run_dir / "metrics.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
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
            for sample in samples:
                file.write(json.dumps({"step": step, **sample}) + "\n")

    def warn(self, message: str) -> None:
        if self.enabled:
            tqdm.write(f"WARNING: {message}", file=sys.stderr)

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def truncate_metrics_file(run_dir: Path, after_step: int) -> None:
    """Drop the metric and sample lines of steps after `after_step`: on resume they will be redone; starting
    fresh (after_step 0) they belong to an earlier run."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        kept = [line for line in path.read_text().splitlines() if line.strip()
                and json.loads(line).get("step", 0) <= after_step]
        path.write_text("".join(line + "\n" for line in kept))
