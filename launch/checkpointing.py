"""The one object that owns a run's progress (the loops see it as grpo.trainer.Checkpoints): where it starts, which
steps are done, and when a checkpoint (models/checkpoint.py) is written: periodic, final, on a stop request."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from grpo.config import Config
from grpo.trainer import Policy, phase
from models.checkpoint import complete_checkpoints, load_checkpoint, save_checkpoint


class Checkpointer:
    """Checkpoints of one run under run_dir/checkpoints/step_<n>/, every rank calling in step. sampler: what holds
    this rank's data position (a PromptSampler or a RemoteRollout); stop_requested: agreed by every rank."""

    def __init__(self, cfg: Config, run_dir: Path, policy: Policy, tokenizer, sampler, dist, *,
                 stop_requested: Callable[[], bool]):
        self.directory = Path(run_dir) / "checkpoints"
        self.policy, self.tokenizer, self.sampler, self.dist = policy, tokenizer, sampler, dist
        self.trainer, self.lora, self.stop_requested = cfg.trainer, cfg.model.lora, stop_requested
        self.start_step = self.completed_steps = 0
        self.positions: list[int] | None = None
        self.step = 1  # the step the run is at: the one in progress, or the one being checkpointed (for errors)

    def resume(self, checkpoint: Path) -> None:
        """Load weights, optimizer, schedule and this rank's data position from `checkpoint` (checked first)."""
        step, extra = load_checkpoint(checkpoint, self.policy.model, self.policy.optimizer)
        self.policy.scheduler.load_state_dict(extra["scheduler"])
        self.positions = list(extra["sampler_position"])  # every rank's, for the rollout ranks of a separate placement
        self.sampler.position = self.positions[self.dist.rank]
        self.start_step = self.completed_steps = step
        self.step = step + 1

    def save(self, step: int) -> None:
        """Write checkpoints/step_<step> (nothing with trainer.checkpoint=none; RuntimeError when a weight is not
        finite), then delete the older ones trainer.keep_last no longer keeps (not later ones an earlier run left)."""
        if self.trainer.checkpoint == "none":
            return
        dist, model = self.dist, self.policy.model
        with phase("checkpoint", step):
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            finite = all(bool(torch.isfinite(p).all()) for p in local)
            if dist.all_reduce_max(torch.tensor(float(not finite), device=dist.device)) > 0:
                raise RuntimeError(f"refusing to write checkpoint step_{step}: the model has non-finite weights")
            # Ranks consume prompts at different rates under dynamic sampling: keep every rank's position.
            one_hot = torch.zeros(dist.world_size, dtype=torch.float64, device=dist.device)
            one_hot[dist.rank] = self.sampler.position
            positions = [int(p) for p in dist.all_reduce_sum(one_hot).tolist()]
            extra = {"scheduler": self.policy.scheduler.state_dict(), "sampler_position": positions}
            optimizer = self.policy.optimizer if self.trainer.checkpoint == "full" else None
            save_checkpoint(self.directory / f"step_{step}", model, self.tokenizer, optimizer, step, extra=extra,
                            merged_export=self.lora.merged_export)
            if self.trainer.keep_last and dist.rank == 0:
                older = [path for done, path in complete_checkpoints(self.directory) if done < step]
                for path in older[:max(0, len(older) - (self.trainer.keep_last - 1))]:
                    shutil.rmtree(path)

    def end_step(self, done: int) -> bool:
        """Record step `done` (1-based): True on a stop request (`finish` checkpoints), else the periodic checkpoint."""
        self.completed_steps = self.step = done
        with phase("stop request", done):
            stop = self.stop_requested()
        if stop:
            return True
        if self.trainer.save_every and done % self.trainer.save_every == 0 and done < self.trainer.steps:
            self.save(done)
        self.step = done + 1
        return False

    def finish(self) -> None:
        """The final checkpoint, at the last finished step."""
        self.step = self.completed_steps
        self.save(self.completed_steps)
