"""Turn a Config into a run (`build`): the start-up checks (launch/preflight.py), the scorer, the policy and its KL
reference, the engine and where the batches come from, the checkpointer and the log, in order of cost."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import Config, ConfigError
from grpo.groups import LocalRollout, PromptSampler, Scorer
from grpo.trainer import Parts, Policy, sync_deadline, train_rl, train_sft
from grpo.update import lr_factor
from launch.checkpointing import Checkpointer
from launch.dist import DistInfo, keep_freed_memory
from launch.plan import Target, attention, describe_batch, own_engine_copy, precision, step_batch, vllm_arguments
from launch.preflight import Prepared, prepare
from launch.reward_pool import reward_functions
from launch.runlog import RunLog, jsonable
from launch.separate import RemoteRollout, serve
from models import load_model, resolve_model_dir
from models.chat import prefix_decoder
from models.fsdp import load_sharded_model
from models.logprobs import sampleable_vocab_size
from models.lora import apply_lora
from models.precision import compute_in
from rollout.hf_engine import HFEngine
from rollout.search import INDEX_ENV
from rollout.tools import Tools
from rollout.vllm_engine import VLLMEngine


@dataclass(frozen=True)
class Run:
    """A built run: the loop this rank runs on its parts, and what launch.train needs around it."""
    loop: Callable  # grpo.trainer.train_rl / train_sft (Parts, dist), or launch.separate.serve (LocalRollout, dist)
    parts: Parts | LocalRollout
    finish: Callable[[Run, object, int], dict]  # (run, the loop's result, the agreed stop signal) -> the summary
    cfg: Config
    dist: DistInfo
    run_dir: Path
    checkpoints: Checkpointer | None = None  # None on an engine rank (it keeps no progress of its own)
    log: RunLog | None = None
    reward_pool: object | None = None  # launch.reward_pool.RewardPool: rewards scored in worker processes

    def close(self) -> None:
        """Close the log and stop the reward workers (the engines are closed by `finish`)."""
        if self.log is not None:
            self.log.close()
        if self.reward_pool is not None:
            self.reward_pool.close()


def build_engine(cfg: Config, target: Target, model_dir: Path, tokenizer, *, device: torch.device, dp_rank: int = 0,
                 policy: torch.nn.Module | None = None):
    """The engine launch/plan.py decides: vLLM, or the transformers engine on the `policy` module itself (when the
    plan lets it) or on a copy in the compute dtype. dp_rank: the replica (its vLLM seed: tp peers sample alike)."""
    if cfg.rollout.engine == "vllm":
        return VLLMEngine(vllm_arguments(cfg, target, str(model_dir), dp_rank))
    if policy is not None and not own_engine_copy(cfg, target):
        return HFEngine(policy, tokenizer, shared=True, num_threads=cfg.rollout.num_threads)
    model = load_model(model_dir, dtype=getattr(torch, precision(cfg, target)["engine"]), device=device,
                       attn_implementation=attention(cfg, target), trust_remote_code=cfg.model.trust_remote_code)
    return HFEngine(model.eval().requires_grad_(False), tokenizer, shared=False, num_threads=cfg.rollout.num_threads)


def _local_rollout(cfg: Config, dist: DistInfo, prepared: Prepared, scorer: Scorer, target: Target, *,
                   policy: torch.nn.Module | None = None) -> LocalRollout:
    """This rank's engine and the rollout on it, multi-turn where rollout.tools names tools (rollout/tools.py).
    policy: the module being trained (None on an engine rank), which the engine generates with or is synced from."""
    roll = cfg.rollout
    if roll.search_index is not None:
        os.environ[INDEX_ENV] = roll.search_index  # read by the search tool, in whichever thread runs it
    engine = build_engine(cfg, target, resolve_model_dir(prepared.source), prepared.tokenizer, device=dist.device,
                          dp_rank=dist.dp_rank, policy=policy)
    synced = roll.engine == "vllm" or own_engine_copy(cfg, target)
    tools = (Tools(prepared.tokenizer, roll.tools, max_turns=roll.max_turns, timeout_s=roll.tool_timeout_s)
             if roll.tools else None)
    return LocalRollout(cfg, engine, scorer, dist, rows=prepared.rows if cfg.stage == "rl" else (),
                        prompt_ids=prepared.prompt_ids, eval_rows=prepared.eval_rows, tools=tools,
                        eval_prompt_ids=prepared.eval_prompt_ids, policy=policy if synced else None)


def build_scorer(cfg: Config, dist: DistInfo, prepared: Prepared) -> tuple[Scorer, object | None]:
    """The run's one Scorer (training and held-out) and its reward worker pool, if any. Each data source's reward
    is first called on its first row with an empty completion: a broken reward ends the start-up in one line."""
    rows = prepared.rows + prepared.eval_rows
    compute_score, compute_scores, pool = reward_functions(cfg.reward, rows, device=str(dist.device))
    first = {}
    for where, row in zip(prepared.places, rows):
        first.setdefault(row["data_source"], (where, row))
    for source, (where, row) in first.items():
        try:
            compute_score(source, "", row["reward_model"]["ground_truth"], row.get("extra_info"))
        except Exception as error:
            if pool is not None:
                pool.close()
            raise ConfigError(f"reward {source!r} on {where} with an empty completion: {type(error).__name__}: "
                              f"{error}") from None
    return Scorer(compute_score, prefix_decoder(prepared.tokenizer), sentence_coef=cfg.reward.sentence_coef,
                  correct_threshold=cfg.reward.correct_threshold, compute_scores=compute_scores), pool


def _load(cfg: Config, dist: DistInfo, source: str | None, key: str, target: Target, *,
          policy: bool) -> torch.nn.Module:
    """The policy (master weights in model.dtype, LoRA, gradient checkpointing) or a frozen model, the KL reference
    or the distillation teacher (compute dtype, eval mode, no gradients), from `source` (named by config `key`);
    under torchrun only rank 0 reads the weights, the others receive their shards (load_sharded_model)."""
    lora = cfg.model.lora

    def add_lora(model):
        try:
            apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                       target_modules=lora.target_modules, seed=cfg.seed)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    prepare_model = add_lora if policy and lora.enabled else None
    common = dict(dtype=getattr(torch, cfg.model.dtype if policy else cfg.model.param_dtype), device=dist.device,
                  attn_implementation=attention(cfg, target), trust_remote_code=cfg.model.trust_remote_code,
                  gradient_checkpointing=policy and cfg.model.gradient_checkpointing)
    try:
        if dist.sharded:
            model = load_sharded_model(source, dist.mesh, param_dtype=getattr(torch, cfg.model.param_dtype),
                                       prepare=prepare_model, **common)
        else:
            model = load_model(source, **common)
            if prepare_model is not None:
                prepare_model(model)
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {error}") from None
    return model if policy else model.eval().requires_grad_(False)


def _policy(cfg: Config, dist: DistInfo, prepared: Prepared, target: Target) -> tuple[Policy, torch.nn.Module | None]:
    """(Policy: model, fused AdamW, lr schedule; the KL reference or None: the frozen start, with LoRA the policy)."""
    model = _load(cfg, dist, prepared.source, prepared.source_key, target, policy=True)
    if not dist.sharded:
        compute_in(model, getattr(torch, cfg.model.param_dtype))  # FSDP2 does this under torchrun
    model.train()  # gradient checkpointing and dropout only act in train mode; engines restore it after generate
    reference = None if cfg.stage != "rl" or cfg.algorithm.kl_coef == 0 else model if cfg.model.lora.enabled else (
        _load(cfg, dist, prepared.source, prepared.source_key, target, policy=False))
    # fused: one kernel over all parameters (DTensor shards too), faster than the per-parameter loop on CPU.
    optim = cfg.optim
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr,
                                  betas=tuple(optim.betas), weight_decay=optim.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, warmup_steps=optim.warmup_steps, total_steps=cfg.trainer.steps, schedule=optim.schedule,
        min_ratio=optim.min_lr_ratio))
    return Policy(model, optimizer, scheduler), reference


def build(cfg: Config, dist: DistInfo, *, stop_requested: Callable[[], bool] = lambda: False,
          rows: list[dict] | None = None, eval_rows: list[dict] | None = None) -> Run:
    """Everything a run needs, checked in order of cost. stop_requested: asked once per step on every rank (Ctrl-C,
    SIGTERM); rows / eval_rows: in memory instead of data.train_files / data.eval_files (launch.api.train)."""
    prepared = prepare(cfg, dist, rows=rows, eval_rows=eval_rows)
    run_dir = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    torch.manual_seed(cfg.seed)
    # The one scorer, where completions are generated (a trainer of a separate placement scores nothing).
    scorer, pool = build_scorer(cfg, dist, prepared) if dist.role != "trainer" else (None, None)
    try:
        if dist.role == "rollout":  # an engine rank of a separate placement: it only generates and scores
            local = _local_rollout(cfg, dist, prepared, scorer, Target.here(1))
            return Run(serve, local, _finish_serving, cfg, dist, run_dir, reward_pool=pool)
        return _training(cfg, dist, prepared, run_dir, scorer, pool, stop_requested)
    except BaseException:
        if pool is not None:
            pool.close()
        raise


def _training(cfg: Config, dist: DistInfo, prepared: Prepared, run_dir: Path, scorer: Scorer | None, pool,
              stop_requested: Callable[[], bool]) -> Run:
    """A training rank's run: policy, rollout (none for SFT without held-out rows), checkpointer, log."""
    if cfg.trainer.keep_freed_memory and dist.device.type == "cpu":
        keep_freed_memory()
    target = Target.here(dist.world_size, torchrun=dist.sharded)
    policy, reference = _policy(cfg, dist, prepared, target)
    teacher = (_load(cfg, dist, cfg.algorithm.teacher, "algorithm.teacher", target, policy=False)
               if cfg.stage == "rl" and cfg.algorithm.teacher is not None else None)
    rollout = None
    if dist.role == "trainer":  # the batches come from the engine ranks (launch/separate.py)
        rollout = RemoteRollout(cfg, dist, policy.model, has_held_out=bool(prepared.eval_rows))
    elif cfg.stage == "rl" or prepared.eval_rows:
        rollout = _local_rollout(cfg, dist, prepared, scorer, target, policy=policy.model)
    sampler = PromptSampler(len(prepared.rows), seed=cfg.seed, rank=dist.dp_rank, world_size=dist.dp_size,
                            shuffle=cfg.data.shuffle) if cfg.stage == "sft" else None  # SFT's own example order
    # What holds this rank's data position: the SFT order, the local sampler, or the serving replica's position.
    position = sampler or (rollout if dist.role == "trainer" else rollout.sampler)
    checkpoints = Checkpointer(cfg, run_dir, policy, prepared.tokenizer, position, dist, stop_requested=stop_requested)
    if prepared.latest is not None:
        try:
            checkpoints.resume(prepared.latest)
        except (OSError, ValueError) as error:
            raise ConfigError(f"resuming from {prepared.latest}: {error}") from None
    if rollout is not None:
        with sync_deadline(cfg.rollout.sync_timeout_s, checkpoints.step, dist.rank):
            if dist.role == "trainer":  # the start broadcast: first step, each replica's position, the weights
                positions = checkpoints.positions or [0] * dist.world_size
                rollout.start(checkpoints.start_step, positions[::dist.world_size // cfg.rollout.num_ranks])
            else:  # the policy may hold resumed or initial weights the engine does not
                rollout.sync_weights()
    start = checkpoints.start_step
    if dist.is_main and start == 0:  # a fresh run: an earlier run's checkpoints go only with trainer.overwrite
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    log = RunLog(cfg, run_dir, start_step=start, enabled=dist.is_main)
    for warning in prepared.warnings:
        log.warn(warning)
    if prepared.latest is not None:
        log.info(f"resumed from {prepared.latest} (step {start} of {cfg.trainer.steps})")
    if cfg.stage == "rl":  # the separate placement's trainers are its data-parallel shares
        log.info(describe_batch(step_batch(cfg, dist.dp_size)))
    parts = Parts(cfg=cfg, policy=policy, rollout=rollout, log=log, checkpoints=checkpoints, reference=reference,
                  teacher=teacher, sampler=sampler, pad_id=prepared.tokenizer.pad_token_id,  # EOS if it had none
                  vocab_size=sampleable_vocab_size(policy.model, prepared.tokenizer), examples=prepared.examples)
    return Run(train_sft if cfg.stage == "sft" else train_rl, parts, _finish_training, cfg, dist, run_dir,
               checkpoints, log, pool)


def held_out_summary(result: dict) -> dict:
    """A held-out result for eval.json: count, means {metric: {mean, low, high}} (95%), values; NaN as null."""
    means = {name: dict(zip(("mean", "low", "high"), interval)) for name, interval in result["means"].items()}
    return jsonable({"count": result["count"], "means": means, "values": result["values"]})


def _finish_training(run: Run, result: dict, stop_signal: int) -> dict:
    """After a training loop: tell the rollout the run ends (or stops), summarise it; eval.json after a full run."""
    completed = run.checkpoints.completed_steps
    stopped = completed < run.cfg.trainer.steps
    if run.parts.rollout is not None:
        run.parts.rollout.close(stop_signal if stopped else 0)
    summary = {"run_dir": str(run.run_dir), "final": result["final"],
               "before": held_out_summary(result["before"]) if "before" in result else {}}
    if stopped:
        return summary | {"interrupted": completed, "signal": stop_signal}
    summary["after"] = held_out_summary(result["after"]) if "after" in result else {}
    if run.dist.is_main:
        (run.run_dir / "eval.json").write_text(json.dumps({key: summary[key] for key in ("before", "after")}, indent=1))
    return summary


def _finish_serving(run: Run, stopped_by: int, stop_signal: int) -> dict:
    """After an engine rank's serve: its engine closed; stopped with the trainers' signal, or ended (0)."""
    run.parts.close()
    return {"run_dir": str(run.run_dir), "rollout_rank": True, "signal": stopped_by}
