"""Turn a Config into what the loops receive (grpo/parts.py): checked data, tokenizer, model (sharded under
torchrun), KL reference, optimizer, schedule, engine with its weight sync, scorer, held-out evaluation, the run
directory's log and the checkpointer that owns progress.

Everything that can be checked without the model is checked first (launch/preflight.py, which --dry-run runs
alone), so a bad recipe fails in seconds and writes nothing to the run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from data.sampler import PromptSampler
from grpo.config import Config
from grpo.evaluate import evaluate, summarize
from grpo.parts import Policy, RLParts, SFTParts
from grpo.schedule import lr_factor
from grpo.scoring import Scorer
from launch.allocator import keep_freed_memory
from launch.checkpointing import Checkpointer
from launch.config import ConfigError, to_dict
from launch.engines import build_engine
from launch.plan import Target, attention
from launch.preflight import Prepared, prepare
from launch.runlog import RunLog, truncate_metrics_file
from launch.watchdog import with_deadline
from models.precision import compute_in


class HeldOut:
    """The run's held-out evaluation (grpo.evaluate.evaluate), remembered by step, so that the loops' curve points
    (trainer.eval_every) and the before/after table are one evaluation, never two."""

    def __init__(self, evaluate_rows: Callable[[], dict]):
        self.evaluate_rows, self.results = evaluate_rows, {}

    def result(self, step: int) -> dict:
        """The whole result after step `step` (per-prompt values and records included)."""
        if step not in self.results:
            try:
                self.results[step] = self.evaluate_rows()
            except Exception as error:  # the run fails naming the phase and the step; the last checkpoint stays
                error.add_note("phase: held-out evaluation")
                raise
        return self.results[step]

    def __call__(self, step: int) -> dict:
        """What the loops log: flat eval/<metric> numbers (grpo.evaluate.summarize)."""
        return summarize(self.result(step))


@dataclass(frozen=True)
class Run:
    """A built run: the loop's parts and what launch.train needs around the loop."""
    parts: RLParts | SFTParts
    run_dir: Path
    log: RunLog
    checkpoints: Checkpointer
    held_out: HeldOut | None  # None without held-out rows
    engine: object | None
    prepared: Prepared  # what the start-up checks produced; owns the reward workers

    def close(self) -> None:
        """Close the log and stop the reward workers (the engine is closed by launch.train after a full run)."""
        self.log.close()
        self.prepared.close()


@dataclass(frozen=True)
class Reference:
    """The KL reference: logprobs of a padded batch under the frozen model the run started from, or, with
    LoRA, under the policy with its adapters disabled."""
    model: torch.nn.Module
    adapters_off: bool
    temperature: float
    chunk_size: int
    vocab_size: int  # the ids the engines can sample, as the policy's logprobs (models.logprobs.sampleable_vocab_size)

    def __call__(self, batch: dict) -> torch.Tensor:
        from models.logprobs import completion_logprobs, evaluating
        from models.lora import disabled_adapters
        with disabled_adapters(self.model) if self.adapters_off else contextlib.nullcontext(), evaluating(self.model):
            return completion_logprobs(self.model, batch, temperature=self.temperature, chunk_size=self.chunk_size,
                                       vocab_size=self.vocab_size)[0]


def _load(cfg: Config, dist, source: str | None, key: str, load: dict, *, gradient_checkpointing: bool = False,
          prepare: Callable[[torch.nn.Module], object] | None = None) -> torch.nn.Module:
    """One model, `prepare`d (LoRA), sharded under torchrun. With several ranks only rank 0 reads the weights;
    the others build the model on the meta device and receive their shards (models.fsdp.load_sharded_model),
    so a node never holds a full copy per rank (8 ranks x 8B in fp32 would be 256 GB of host memory)."""
    from models import load_model
    try:
        if dist.sharded:
            from models.fsdp import load_sharded_model
            return load_sharded_model(source, dist.mesh, param_dtype=getattr(torch, cfg.model.param_dtype),
                                      device=dist.device, attn_implementation=load["attn_implementation"],
                                      gradient_checkpointing=gradient_checkpointing, dtype=load["dtype"],
                                      trust_remote_code=load["trust_remote_code"], prepare=prepare)
        model = load_model(source, gradient_checkpointing=gradient_checkpointing, **load)
        if prepare is not None:
            prepare(model)
        return model
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None


def _policy(cfg: Config, dist, source: str | None, key: str, load: dict, tokenizer):
    """(Policy, reference-logprob function or None, the sampleable vocabulary size): the model (LoRA adapters
    applied, sharded under torchrun), fused AdamW over its trainable weights, the warmup/decay schedule, and the
    frozen KL reference."""
    from models.logprobs import sampleable_vocab_size
    lora, prepare = cfg.model.lora, None
    if lora.enabled:
        from models.lora import apply_lora

        def prepare(model):
            try:
                apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=lora.target_modules, seed=cfg.seed)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    model = _load(cfg, dist, source, key, load, gradient_checkpointing=cfg.model.gradient_checkpointing,
                  prepare=prepare)
    compute = getattr(torch, cfg.model.param_dtype)
    if not dist.sharded:
        compute_in(model, compute)  # fp32 master weights, bf16 products (FSDP2 does this under torchrun)
    model.train()  # gradient checkpointing and dropout only act in train mode; engines restore it after generate
    vocab_size = sampleable_vocab_size(model, tokenizer)
    reference = None
    if cfg.stage == "rl" and cfg.algorithm.kl_coef > 0:
        # LoRA: the policy with its adapters off (no second model); else the frozen starting model, stored in
        # the compute dtype (a frozen model needs no master copy: launch.plan.precision).
        reference_model = model if lora.enabled else _load(cfg, dist, source, key, dict(load, dtype=compute)
                                                           ).eval().requires_grad_(False)
        reference = Reference(reference_model, adapters_off=lora.enabled, temperature=cfg.rollout.temperature,
                              chunk_size=cfg.model.logprob_chunk_size, vocab_size=vocab_size)
    # fused: one kernel over all parameters (CPU and CUDA, DTensor shards too); measured 4x faster than the
    # per-parameter loop on CPU (bench/README.md).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.trainer.steps, schedule=cfg.optim.schedule,
        min_ratio=cfg.optim.min_lr_ratio))
    return Policy(model, optimizer, scheduler), reference, vocab_size


def build(cfg: Config, dist, *, resume: bool = False, stop_requested: Callable[[], bool] = lambda: False) -> Run:
    """Everything a run needs, checked in order of cost (launch/preflight.py first: nothing is written to the run
    directory before every check passed). resume=True is trainer.resume=always (the --resume flag);
    stop_requested: asked once per step on every rank (Ctrl-C, SIGTERM)."""
    if resume:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="always"))
    prepared = prepare(cfg, dist)
    try:
        return _assemble(cfg, dist, prepared, stop_requested)
    except BaseException:
        prepared.close()
        raise


def _assemble(cfg: Config, dist, prepared: Prepared, stop_requested: Callable[[], bool]) -> Run:
    rows, eval_rows, tokenizer, source = prepared.rows, prepared.eval_rows, prepared.tokenizer, prepared.source
    run_dir = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    torch.manual_seed(cfg.seed)
    if cfg.trainer.keep_freed_memory and dist.device.type == "cpu":
        keep_freed_memory()
    target = Target.here(dist.world_size, torchrun=dist.sharded)
    load = dict(dtype=getattr(torch, cfg.model.dtype), device=dist.device, attn_implementation=attention(cfg, target),
                trust_remote_code=cfg.model.trust_remote_code)
    policy, reference, vocab_size = _policy(cfg, dist, source, prepared.source_key, load, tokenizer)
    # One order over the rows per replica: the ranks of a tensor-parallel replica draw the same prompts.
    sampler = PromptSampler(len(rows), seed=cfg.seed, rank=dist.dp_rank, world_size=dist.dp_size,
                            shuffle=cfg.data.shuffle)
    checkpoints = Checkpointer(run_dir, policy, tokenizer, sampler, dist, lora=cfg.model.lora, steps=cfg.trainer.steps,
                               save_every=cfg.trainer.save_every, keep_last=cfg.trainer.keep_last,
                               stop_requested=stop_requested)
    if prepared.latest is not None:
        try:
            checkpoints.resume(prepared.latest)
        except (OSError, ValueError) as error:
            raise ConfigError(f"resuming from {prepared.latest}: {error}") from None

    engine, sync_weights = None, (lambda: {})
    if cfg.stage == "rl" or eval_rows:
        from models.loading import resolve_model_dir
        engine, engine_sync = build_engine(cfg, target, resolve_model_dir(source), tokenizer, device=dist.device,
                                           dp_rank=dist.dp_rank, policy=policy.model)
        if engine_sync is not None:
            limit = f"rollout.sync_timeout_s={cfg.rollout.sync_timeout_s:g} s"
            sync_weights = with_deadline(engine_sync, cfg.rollout.sync_timeout_s, limit, lambda: (
                f"weight sync (phase: sync) at step {checkpoints.step} on rank {dist.rank}"))
            sync_weights()  # the policy may hold resumed or initial weights the engine does not
    from launch.triples import install_factqa_reward
    install_factqa_reward(cfg.reward, device=str(dist.device))  # a non-default factqa_corpus reward (model extractor)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if cfg.trainer.resume != "never":  # lines of steps after the checkpoint (or all, starting fresh) are redone
            truncate_metrics_file(run_dir, checkpoints.start_step)
    log = RunLog(run_dir, total_steps=cfg.trainer.steps, start_step=checkpoints.start_step, enabled=dist.is_main,
                 description=cfg.stage)
    for warning in prepared.warnings:
        log.warn(warning)

    import rewards
    from models.chat import prefix_decoder
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pool = prepared.reward_pool  # reward.num_workers > 0: every reward call goes through the workers
    scorer = Scorer(pool.compute_score if pool else rewards.compute_score, prefix_decoder(tokenizer),
                    sentence_coef=cfg.reward.sentence_coef, correct_threshold=cfg.reward.correct_threshold,
                    compute_scores=pool.compute_scores if pool else None)
    held_out = None
    if eval_rows:
        held_out = HeldOut(functools.partial(
            evaluate, engine, scorer, eval_rows, prepared.eval_prompt_ids, dist,
            max_new_tokens=cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens,
            batch_size=cfg.trainer.eval_batch_size))
    if cfg.stage == "sft":
        parts = SFTParts(policy, prepared.examples, sampler, pad_id, log, checkpoints, evaluate=held_out)
    else:
        parts = RLParts(policy, engine, sync_weights, reference, rows, prepared.prompt_ids, sampler, scorer, pad_id,
                        log, checkpoints, evaluate=held_out, vocab_size=vocab_size)
    return Run(parts, run_dir, log, checkpoints, held_out, engine, prepared)
